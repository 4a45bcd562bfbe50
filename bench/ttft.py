"""Time to first token of one request on an idle native engine on a GPU, by prompt length.

For each model shape (random bf16 weights, as bench/native_gpu.py makes them) and prompt length n: the
first request of n tokens after the engine is ready (cold: it may compile kernels) and the median of
the next `--repeats`, of n + 1, n + 2, ... tokens (a length not seen before costs what a new one does
in service), each a fresh random prompt (nothing cached), one new token asked; next to
the prefill's FLOPs at the measured bf16 matmul rate, the time no engine can beat. A short prompt
runs in the decode step's CUDA graphs (sequence.DecodeRows), a longer one takes the eager prefill
path in as few chunks as the pacer allows, so the figures show the host's floor at short prompts and
the matmul rate at long ones.

Writes bench/results/ttft.json and ttft.png.

    python bench/ttft.py [--shapes smollm2-135m,llama-3.2-1b,llama-3.1-8b] [--lengths 7,24,60,200,1000,4000]
                         [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpu_roofline import matmul_peak  # noqa: E402
from bench.native_burst import SHAPES, engine_for, make_folder, unload  # noqa: E402
from bench.structured import machine  # noqa: E402
from worker.engines.hosted import settle  # noqa: E402
from worker.request import GenerationRequest, SamplingParams  # noqa: E402

RESULTS = REPO / "bench" / "results"


async def first_token_ms(engine, ids: list[int]) -> float:
    request = GenerationRequest(request_id=f"t{random.random()}", prompt_token_ids=ids,
                                sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    async for out in engine.stream_predict(request):
        if out.token_ids:
            return (time.perf_counter() - started) * 1000
    raise RuntimeError("the stream ended without a token")


async def shape_run(name: str, lengths: list[int], repeats: int, peak: float, work: Path) -> dict:
    folder = work / name
    make_folder(SHAPES[name], torch.bfloat16, folder)
    torch.cuda.empty_cache()
    engine = engine_for(folder, "bfloat16")
    await engine.load_model()
    settle()
    rng = random.Random(5)
    vocab = SHAPES[name]["vocab_size"]
    rows = []
    try:
        for length in lengths:
            prompt = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
            cold = await first_token_ms(engine, prompt(length))
            warm = [await first_token_ms(engine, prompt(length + i)) for i in range(1, repeats + 1)]
            work = engine.pacer.work(length, 0)
            bound_ms = (work.linear + work.pairs) / peak * 1000
            rows.append({"prompt_tokens": length, "cold_ms": cold, "ttft_ms": statistics.median(warm),
                         "ttft_ms_runs": warm, "prefill_flops_bound_ms": bound_ms,
                         "in_graphs": length <= engine.graphs.max_batch
                         and engine.decode_rows(SimpleNamespace(num_cached=0, draft=[]), length)})
            print(json.dumps({"shape": name, **rows[-1]}), flush=True)
    finally:
        await unload(engine)
    return {"shape": name, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in result["shapes"]:
        lengths = [r["prompt_tokens"] for r in shape["rows"]]
        line, = ax.plot(lengths, [r["ttft_ms"] for r in shape["rows"]], marker="o", label=f"{shape['shape']} (median)")
        ax.plot(lengths, [r["prefill_flops_bound_ms"] for r in shape["rows"]], ls="--", color=line.get_color(),
                label=f"{shape['shape']} prefill FLOPs / matmul rate")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (nothing cached)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"native engine, one request on an idle engine: {result['machine'].get('gpu', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--lengths", default="7,24,60,200,1000,4000")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("a CUDA GPU is needed (bench/engines_cpu.py measures the embedded model on a CPU)")
    lengths = [int(n) for n in options.lengths.split(",")]
    result = {"benchmark": "ttft", "machine": machine("cuda"), "torch": torch.__version__,
              "when": time.strftime("%Y-%m-%d %H:%M"), "matmul_peak_flops": matmul_peak("cuda"), "shapes": []}
    with tempfile.TemporaryDirectory() as work:
        for name in options.shapes.split(","):
            result["shapes"].append(await shape_run(name, lengths, options.repeats, result["matmul_peak_flops"],
                                                    Path(work)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ttft.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "ttft.png")
    print(f"wrote {RESULTS / 'ttft.json'} and ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
