"""gRPC-over-UDS vs in-process on the same engine, in one run: tokens/s ratio, TTFT and inter-token times.

Synthetic engine (100k tokens/s aggregate) at 1, 64 and 256 streams, and the embedded model at 1 and 8.
Writes bench/results/transport.json and transport.png.

    python bench/transport.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SYNTHETIC = ["--engine", "synthetic", "--set", "engine.args.tokens_per_s=100000",
             "--set", "engine.args.max_model_len=1000000", "--set", "engine.args.budget_tokens=100000000",
             "--set", "resources.max_concurrency=1024", "--set", "resources.max_queue=1024"]
EMBEDDED = ["--engine", "transformers", "--model", "smollm2-135m-instruct", "--set", "resources.max_concurrency=8"]


def cy_llm(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker", *args]


def wait_ready(socket_path: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    sys.path.insert(0, str(REPO))
    from worker.client import channel_for, wait_until_ready

    with channel_for(socket_path) as channel:
        if not wait_until_ready(channel, timeout) or proc.poll() is not None:
            raise RuntimeError("worker did not become ready")


def bench_once(args: list[str]) -> dict:
    # Through a file: an engine may log to stdout (vLLM does).
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(cy_llm("bench", *args, "--json", f"{tmp}/result.json"), capture_output=True, text=True,
                       check=True, cwd=REPO)
        return json.loads(Path(f"{tmp}/result.json").read_text())


def middle(values: list):
    """A field of repeated runs as one value: a number's median, a string (the mode) as it is."""
    return values[0] if isinstance(values[0], str) else statistics.median(values)


def compare(name: str, engine_args: list[str], cases: list[tuple[int, int]]) -> list[dict]:
    socket_dir = tempfile.mkdtemp(prefix="cyllm-bench-", dir="/tmp")
    socket_path = f"{socket_dir}/w.sock"
    worker = subprocess.Popen(cy_llm("serve", "--socket", socket_path, "--set", "server.log_level=warning",
                                     *engine_args), cwd=REPO)
    rows = []
    try:
        wait_ready(socket_path, worker)
        for streams, max_tokens in cases:
            common = ["--streams", str(streams), "--max-tokens", str(max_tokens)]
            grpc_result = bench_once(["--socket", socket_path, *common])
            local = bench_once(["--in-process", *engine_args, *common])
            row = {
                "engine": name, "streams": streams, "max_tokens": max_tokens,
                "grpc": grpc_result, "in_process": local,
                "tokens_per_s_ratio": grpc_result["tokens_per_s"] / local["tokens_per_s"],
                "ttft_p50_added_ms": grpc_result["ttft_ms_p50"] - local["ttft_ms_p50"],
            }
            rows.append(row)
            print(f"{name:12s} {streams:4d} streams: grpc {grpc_result['tokens_per_s']:9.0f} tok/s "
                  f"({grpc_result['messages_per_s']:7.0f} msg/s), in-process {local['tokens_per_s']:9.0f} tok/s, "
                  f"ratio {row['tokens_per_s_ratio']:.3f}; TTFT p50 {grpc_result['ttft_ms_p50']:.1f} vs "
                  f"{local['ttft_ms_p50']:.1f} ms", flush=True)
    finally:
        worker.terminate()
        worker.wait(30)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['streams']} streams" for r in rows]
    x = range(len(rows))
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    tput.bar([i - width / 2 for i in x], [r["grpc"]["tokens_per_s"] for r in rows], width, label="gRPC over UDS")
    tput.bar([i + width / 2 for i in x], [r["in_process"]["tokens_per_s"] for r in rows], width, label="in-process")
    for i, r in enumerate(rows):
        tput.annotate(f"{r['tokens_per_s_ratio']:.2f}x", (i, max(r["grpc"]["tokens_per_s"],
                      r["in_process"]["tokens_per_s"])), ha="center", va="bottom", fontsize=8)
    tput.set_yscale("log")
    tput.set_ylabel("tokens/s (log)")
    tput.set_title("Throughput, same engine, same run")
    tput.set_xticks(list(x), labels, fontsize=8)
    tput.legend()
    ttft.bar([i - width / 2 for i in x], [r["grpc"]["ttft_ms_p50"] for r in rows], width, label="gRPC p50")
    ttft.bar([i + width / 2 for i in x], [r["in_process"]["ttft_ms_p50"] for r in rows], width, label="in-process p50")
    ttft.set_yscale("log")
    ttft.set_ylabel("time to first token, ms (log)")
    ttft.set_title("TTFT p50")
    ttft.set_xticks(list(x), labels, fontsize=8)
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="synthetic engine only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    # About 2 s of generation per synthetic case: 200k tokens shared by the streams.
    rows = compare("synthetic", SYNTHETIC, [(n, 200_000 // n) for n in (1, 64, 256)])
    if not args.quick:
        rows += compare("smollm2-135m", EMBEDDED, [(1, 64), (8, 64)])
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "transport", "machine": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d %H:%M"),
              "seconds": round(time.time() - started, 1), "rows": rows}
    (RESULTS / "transport.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, RESULTS / "transport.png")
    print(f"wrote {RESULTS / 'transport.json'} and transport.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
