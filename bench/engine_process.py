"""The engine in the worker's process against in its own (engine.own_process), in one run: a
worker of each, alternated round by round, driven over its socket by `cy-llm bench` (streams of
128 tokens, greedy, speculation off): tokens/s, TTFT p50/p99 and inter-token time at 1, 8 and 32
streams, and each case's ratio own / in process (the median over rounds).

The native engine on the embedded model (--device cpu) or, with --device cuda, in bf16; --model
takes a folder (random weights: bench/structured.py's random_weights). Writes
bench/results/engine_process[_cuda].json and .png.

    python bench/engine_process.py [--device cpu|cuda] [--model FOLDER] [--rounds 2] [--streams 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import drawn_at_random, machine  # noqa: E402
from bench.transport import bench_once, cy_llm, wait_ready  # noqa: E402

RESULTS = REPO / "bench" / "results"
MODES = ("false", "true")  # engine.own_process


def measure(engine_args: list[str], own: str, streams: list[int], max_tokens: int) -> dict[int, dict]:
    socket_dir = tempfile.mkdtemp(prefix="cyllm-own-", dir="/tmp")
    socket_path = f"{socket_dir}/w.sock"
    worker = subprocess.Popen(cy_llm("serve", "--socket", socket_path, "--set", "server.log_level=warning",
                                     "--set", f"engine.own_process={own}", *engine_args), cwd=REPO)
    try:
        wait_ready(socket_path, worker)
        bench_once(["--socket", socket_path, "--streams", "1", "--max-tokens", "16"])  # first requests' costs
        return {n: bench_once(["--socket", socket_path, "--streams", str(n), "--max-tokens", str(max_tokens)])
                for n in streams}
    finally:
        worker.terminate()
        worker.wait(60)


def summary(rows: list[dict], streams: list[int]) -> dict:
    out = {}
    for n in streams:
        pairs = [(r["results"]["false"][n], r["results"]["true"][n]) for r in rows]
        out[str(n)] = {
            "tokens_per_s_ratio": statistics.median(own["tokens_per_s"] / base["tokens_per_s"] for base, own in pairs),
            "tokens_per_s_ratio_rounds": [own["tokens_per_s"] / base["tokens_per_s"] for base, own in pairs],
            **{f"{key}_{mode}": statistics.median(p[i][key] for p in pairs)
               for i, mode in enumerate(("in_process", "own_process"))
               for key in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50")},
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = list(result["summary"])
    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(streams))
    for offset, mode, label in ((-0.2, "in_process", "engine in the worker's process"),
                                (0.2, "own_process", "engine in its own process")):
        rate.bar([i + offset for i in x], [result["summary"][s][f"tokens_per_s_{mode}"] for s in streams], 0.4,
                 label=label)
        ttft.bar([i + offset for i in x], [result["summary"][s][f"ttft_ms_p50_{mode}"] for s in streams], 0.4,
                 label=label)
    for axis, title in ((rate, "tokens/s (median of rounds)"), (ttft, "TTFT p50, ms")):
        axis.set_xticks(list(x), [f"{s} streams\n{result['summary'][s]['tokens_per_s_ratio']:.2f}x" if axis is rate
                                  else f"{s} streams" for s in streams])
        axis.set_title(title, fontsize=9)
    rate.legend(fontsize=8)
    fig.suptitle(f"{result['machine'].get('gpu', result['machine']['cpu'])}: engine.own_process", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", help="a model folder (default the embedded model)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    options = parser.parse_args()
    streams = [int(n) for n in options.streams.split(",")]
    engine_args = ["--engine", "native", "--set", f"engine.device={options.device}", "--set",
                   "engine.args.speculation=off", "--set", "resources.max_concurrency=64"]
    if options.device == "cuda":
        engine_args += ["--set", "engine.dtype=bfloat16"]
    if options.model:
        engine_args += ["--model", options.model]
    rows = []
    for round_ in range(options.rounds):
        row = {"round": round_, "results": {}}
        for own in MODES:
            row["results"][own] = measure(engine_args, own, streams, options.max_tokens)
            for n, result in row["results"][own].items():
                print(f"round {round_} own_process={own} {n:3d} streams: {result['tokens_per_s']:9.0f} tok/s, "
                      f"TTFT p50 {result['ttft_ms_p50']:.1f} ms", flush=True)
        rows.append(row)
    result = {"benchmark": "engine_process", "machine": machine(options.device), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "random_weights": bool(options.model) and drawn_at_random(Path(options.model)),
              "rows": rows, "summary": summary(rows, streams)}
    print(json.dumps(result["summary"], indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "engine_process" + ("_cuda" if options.device == "cuda" else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
