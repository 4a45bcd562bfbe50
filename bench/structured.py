"""Structured output's cost on the native engine: tokens/s with a json_schema constraint against none,
the same chat prompts (free text to max_tokens; the schema's JSON is long enough to get there, the
JSON's own lengths are recorded), at batch 1 and 8 (or the sizes given), in one run with the two alternated
round by round (a shared machine's slow spell falls on both); and the schema's compile time, first
and cached. Tokens/s is completion tokens over the batch's wall time, prefill included.

Writes bench/results/structured_<device>.json and .png.

    python bench/structured.py [--device cpu|cuda] [--batches 1,8] [--repeats 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "documentary", "romance"]}},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genres", "cast", "summary"],
}
PROMPT = "Describe a film you like, with its cast and a long summary, as JSON."


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import grpc

    from tests.conftest import WorkerProcess
    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    batches = [int(b) for b in options.batches.split(",")]
    worker = WorkerProcess("--engine", "native", "--model", options.model, "--set", f"engine.device={options.device}",
                           "--set", f"resources.max_concurrency={max(batches)}")
    try:
        worker.wait_ready(600)
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            compile_ms = compile_times(options.model, options.device)

            def request(seed: int, constrained: bool) -> pb.PredictRequest:
                return pb.PredictRequest(
                    chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
                    # Free text runs to max_tokens (ignore_eos), as the long JSON does, so the two batches
                    # keep their streams equally long; a constraint cannot take ignore_eos.
                    sampling=pb.SamplingParams(max_tokens=options.max_tokens, temperature=1.0, seed=seed,
                                               ignore_eos=not constrained),
                    structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)) if constrained else None)

            def run(batch: int, constrained: bool, round_: int) -> dict:
                started = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    replies = list(pool.map(lambda i: list(stub.StreamPredict(request(1000 * round_ + i, constrained))),
                                            range(batch)))
                wall = time.perf_counter() - started
                tokens = sum(r[-1].usage.completion_tokens for r in replies)
                return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}

            run(1, True, 99)  # warm: the schema compiled, the step paths run once
            rows = []
            for batch in batches:
                runs = {False: [], True: []}
                for round_ in range(options.repeats):
                    for constrained in (False, True):
                        runs[constrained].append(run(batch, constrained, round_))
                ratios = [c["tokens_per_s"] / f["tokens_per_s"] for f, c in zip(runs[False], runs[True])]
                rows.append({"batch": batch,
                             "free_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[False]),
                             "constrained_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[True]),
                             "ratio": statistics.median(ratios), "ratios": ratios, "runs": runs})
    finally:
        worker.stop()
    result = {"benchmark": "structured", "device": options.device, "machine": machine(options.device),
              "when": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": options.max_tokens, "schema": SCHEMA,
              "compile_ms": compile_ms, "rows": rows,
              "targets": {"ratio": 0.9 if options.device == "cpu" else 0.95}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"structured_{options.device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    for row in rows:
        print(f"batch {row['batch']}: free {row['free_tokens_per_s']:.1f} tok/s, json_schema "
              f"{row['constrained_tokens_per_s']:.1f} tok/s, ratio {row['ratio']:.3f} {[round(r, 3) for r in row['ratios']]}")
    print(f"compile: {compile_ms}")
    return 0


def compile_times(model: str, device: str) -> dict:
    """The schema compiled for the model's tokenizer in this process: first, then from the cache."""
    from worker.engines.grammar import Grammars
    from worker.engines.prompt import load_tokenizer
    from worker.models import locate_model
    from worker.request import Constraint

    folder = locate_model(model, os.environ.get("CYLLM_CACHE_DIR", str(Path.home() / ".cache" / "cy-llm" / "models")))
    tokenizer = load_tokenizer(folder)
    started = time.perf_counter()
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    tokenizer_ms = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(2):
        started = time.perf_counter()
        grammars.compile(Constraint("json_schema", json.dumps(SCHEMA)))
        times.append((time.perf_counter() - started) * 1000)
    return {"tokenizer_info_ms": round(tokenizer_ms, 2), "first_ms": round(times[0], 3), "cached_ms": round(times[1], 3)}


def machine(device: str) -> dict:
    info = {"cores": os.cpu_count(), "cpu": "unknown", "cpu_flags": []}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            info["cpu_flags"] = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
            break
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["free_tokens_per_s"] for r in rows], 0.4, label="no constraint")
    ax.bar([i + 0.2 for i in x], [r["constrained_tokens_per_s"] for r in rows], 0.4, label="json_schema")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["constrained_tokens_per_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"native, {result['device']}: {result['machine'].get('gpu', result['machine']['cpu'])}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
