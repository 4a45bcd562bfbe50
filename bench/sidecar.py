"""Through the sidecar vs straight to the worker's socket, in one run.

1. tokens/s ratio and TTFT at 1, 64 and 256 streams on the synthetic engine (100k tokens/s), the
   median of --repeats runs of each path, alternated (at 256 streams one run's TTFT p50 ranged
   from 54 to 135 ms straight to the worker on the same host);
2. added latency per streamed message: a direct stream and a sidecar stream run side by side on a worker in lockstep (every running request gets one
   token per 10 ms step), so token k of both is made in the same step; the arrival difference, less
   whole steps of admission offset, is what the sidecar adds to each message;
3. added TTFT: sequential one-token requests, each path on a warm connection.

Writes bench/results/sidecar.json and sidecar.png. Needs `cargo build --release` of sidecar/.

    python bench/sidecar.py                  # everything
    python bench/sidecar.py --per-message    # only the per-message figure, printed
    python bench/sidecar.py --runs 48        # more stream pairs: a tighter per-message estimate
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.transport import SYNTHETIC, bench_once, cy_llm, middle, wait_ready  # noqa: E402
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb  # noqa: E402
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
STEP_MS = 10.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sidecar_binary() -> Path:
    if os.environ.get("CYLLM_SIDECAR_BIN"):  # a prebuilt binary, for a machine without cargo
        return Path(os.environ["CYLLM_SIDECAR_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache" / "cy-llm" / "cargo-target"))
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO / "sidecar", check=True,
                   env={**os.environ, "CARGO_TARGET_DIR": str(target)})
    return target / "release" / "cy-llm-sidecar"


class Stack:
    """A worker and a sidecar in front of it."""

    def __init__(self, engine_args: list[str], env: dict[str, str] | None = None):
        binary = sidecar_binary()
        env = {**os.environ, **(env or {})}
        self.socket = f"{tempfile.mkdtemp(prefix='cyllm-bench-', dir='/tmp')}/w.sock"
        self.worker = subprocess.Popen(cy_llm("serve", "--socket", self.socket, "--set", "server.log_level=warning",
                                              *engine_args), cwd=REPO, env=env)
        wait_ready(self.socket, self.worker)
        self.port = free_port()
        self.sidecar = subprocess.Popen([str(binary), f"--worker=unix://{self.socket}",
                                         "--grpc-addr", f"127.0.0.1:{self.port}", "--http-addr", f"127.0.0.1:{free_port()}",
                                         "--metrics-addr", f"127.0.0.1:{free_port()}", "--log", "warn"], env=env)
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for _ in range(200):
                try:
                    list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=1)), timeout=2))
                    break
                except grpc.RpcError:
                    time.sleep(0.05)

    def stop(self) -> None:
        for proc in (self.sidecar, self.worker):
            proc.terminate()
            proc.wait(30)


def stream_arrivals(target: str, tokens: int, index: int, go, first_token) -> list[float]:
    """One client process reading one stream: the arrival time (CLOCK_MONOTONIC, which every process
    shares) of each token. Sets `first_token` when the first one is in."""
    go.wait()
    request = pb.PredictRequest(prompt=f"pair {index}", return_token_ids=True,
                                sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True))
    times = []
    with grpc.insecure_channel(target) as channel:
        for response in pb_grpc.InferenceServiceStub(channel).StreamPredict(request):
            times.extend([time.perf_counter()] * len(response.token_ids))
            first_token.set()
    return times


def paired_stream(pool, direct: str, via: str, tokens: int, index: int, via_first: bool) -> list[float]:
    """Per-token arrival differences (sidecar - direct) in ms for one pair of streams made in lockstep.

    Each stream has its own client process, so neither waits for the other to be read. The worker
    writes the two streams one after the other within a step, so the one admitted first leaves first
    by a few tens of microseconds: runs alternate which path is admitted first (the second starts
    once the first has a token) and the estimate averages the two orders.
    """
    import multiprocessing

    manager = multiprocessing.Manager()
    go, first_token, never = manager.Event(), manager.Event(), manager.Event()
    first, second = (via, direct) if via_first else (direct, via)
    leader = pool.apply_async(stream_arrivals, (first, tokens, index, go, first_token))
    go.set()
    first_token.wait(10)
    follower = pool.apply_async(stream_arrivals, (second, tokens, index, go, never))
    leader_times, follower_times = leader.get(60), follower.get(60)
    manager.shutdown()
    via_times, direct_times = (leader_times, follower_times) if via_first else (follower_times, leader_times)
    diffs = [v - d for d, v in zip(direct_times, via_times)]
    # Token k of both was made j steps apart (j whole steps of admission offset); remove them.
    step = STEP_MS / 1000
    offset = round(sorted(diffs)[len(diffs) // 2] / step) * step
    return [(d - offset) * 1000 for d in diffs[1:]]


def round_trips(target: str, count: int) -> list[float]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=1))
        list(stub.StreamPredict(request))
        times = []
        for _ in range(count):
            started = time.perf_counter()
            list(stub.StreamPredict(request))
            times.append((time.perf_counter() - started) * 1000)
    return times


def added_per_message(pool, direct: str, via: str, runs: int) -> dict:
    by_order: dict[str, list[float]] = {"direct_first": [], "via_first": []}
    for i in range(runs):
        via_first = i % 2 == 1
        by_order["via_first" if via_first else "direct_first"].extend(paired_stream(pool, direct, via, 150, i, via_first))
    p50 = {order: percentile(samples, 50) * 1000 for order, samples in by_order.items()}
    p99 = {order: percentile(samples, 99) * 1000 for order, samples in by_order.items()}
    return {"order_p50_us": p50, "order_p99_us": p99,
            "added_us_p50": sum(p50.values()) / 2, "added_us_p99": sum(p99.values()) / 2,
            "added_ms_samples": [round(a, 4) for samples in by_order.values() for a in samples]}


def per_message(runs: int) -> dict:
    """What the sidecar adds to each message, next to what a byte relay (socat, when installed)
    adds on the same hop: the floor for any proxy process on this machine."""
    import multiprocessing
    import shutil

    lockstep = Stack(["--engine", "synthetic", "--set", f"engine.args.step_ms={STEP_MS}",
                      "--set", "resources.max_concurrency=64"])
    relay = None
    pool = multiprocessing.get_context("spawn").Pool(2)
    try:
        direct = f"unix:{lockstep.socket}"
        result = added_per_message(pool, direct, f"127.0.0.1:{lockstep.port}", runs)
        if shutil.which("socat"):
            port = free_port()
            relay = subprocess.Popen(["socat", f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr,nodelay",
                                      f"UNIX-CONNECT:{lockstep.socket}"])
            time.sleep(0.5)  # socat binds after fork; it prints nothing to wait on
            floor = added_per_message(pool, direct, f"127.0.0.1:{port}", runs)
            result["byte_relay"] = {k: v for k, v in floor.items() if k != "added_ms_samples"}
    finally:
        pool.close()
        if relay is not None:
            relay.terminate()
            relay.wait()
        lockstep.stop()
    result["method"] = (f"{runs} runs of one direct and one proxied stream made in lockstep ({STEP_MS} ms steps), "
                        "150 tokens each, each read by its own client process; the order of admission alternates "
                        "and the estimate is the mean of the two orders' percentiles")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]
    fig, (tput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    width = 0.38
    tput.bar([i - width / 2 for i in x], [r["direct"]["tokens_per_s"] for r in rows], width, label="direct (UDS)")
    tput.bar([i + width / 2 for i in x], [r["sidecar"]["tokens_per_s"] for r in rows], width, label="through the sidecar")
    for i, r in enumerate(rows):
        tput.annotate(f"{r['tokens_per_s_ratio']:.3f}x", (i, r["direct"]["tokens_per_s"]), ha="center", va="bottom")
    tput.set_xticks(list(x), [f"{r['streams']} streams" for r in rows])
    tput.set_ylabel("tokens/s")
    tput.set_title("Synthetic engine at 100k tokens/s")
    tput.legend(loc="lower right")
    added = result["per_message"]["added_ms_samples"]
    latency.hist(added, bins=80, range=(-0.5, 1.5), color="tab:orange")
    latency.axvline(result["per_message"]["added_us_p50"] / 1000, color="k", linestyle="--",
                    label=f"p50 {result['per_message']['added_us_p50']:.0f} us")
    if "byte_relay" in result["per_message"]:
        relay = result["per_message"]["byte_relay"]["added_us_p50"]
        latency.axvline(relay / 1000, color="tab:green", linestyle=":", label=f"byte relay (socat) p50 {relay:.0f} us")
    latency.set_xlabel("added latency per message, ms (paired lockstep streams)")
    latency.set_title("What the sidecar adds to each streamed message")
    latency.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--per-message", action="store_true", help="only the per-message figure, printed")
    parser.add_argument("--runs", type=int, default=16, help="pairs of lockstep streams for the per-message figure")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path at each stream count")
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if options.per_message:
        print(json.dumps({k: v for k, v in per_message(options.runs).items() if k != "added_ms_samples"}, indent=1))
        return 0
    result: dict = {"benchmark": "sidecar", "machine": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d %H:%M")}
    stack = Stack(SYNTHETIC)
    try:
        rows = []
        for streams in (1, 64, 256):
            common = ["--streams", str(streams), "--max-tokens", str(200_000 // streams)]
            runs: dict[str, list[dict]] = {"direct": [], "sidecar": []}
            for _ in range(options.repeats):
                runs["direct"].append(bench_once(["--socket", stack.socket, *common]))
                runs["sidecar"].append(bench_once(["--target", f"127.0.0.1:{stack.port}", *common]))
            direct, via = ({key: middle([run[key] for run in runs[side]]) for key in runs[side][0]}
                           for side in ("direct", "sidecar"))
            rows.append({"streams": streams, "direct": direct, "sidecar": via, "runs": runs,
                         "tokens_per_s_ratio": via["tokens_per_s"] / direct["tokens_per_s"],
                         "ttft_p50_added_ms": via["ttft_ms_p50"] - direct["ttft_ms_p50"]})
            print(f"{streams:4d} streams: direct {direct['tokens_per_s']:8.0f} tok/s, sidecar {via['tokens_per_s']:8.0f} "
                  f"tok/s, ratio {rows[-1]['tokens_per_s_ratio']:.3f}; TTFT p50 {direct['ttft_ms_p50']:.1f} -> "
                  f"{via['ttft_ms_p50']:.1f} ms", flush=True)
        result["throughput"] = rows
        direct_rtt, via_rtt = round_trips(f"unix:{stack.socket}", 300), round_trips(f"127.0.0.1:{stack.port}", 300)
        result["round_trip"] = {
            "direct_ms_p50": percentile(direct_rtt, 50), "sidecar_ms_p50": percentile(via_rtt, 50),
            "direct_ms_p99": percentile(direct_rtt, 99), "sidecar_ms_p99": percentile(via_rtt, 99),
            "added_ttft_ms_p50": percentile(via_rtt, 50) - percentile(direct_rtt, 50),
            "added_ttft_ms_p99": percentile(via_rtt, 99) - percentile(direct_rtt, 99),
        }
        print(f"one-token round trip p50: direct {result['round_trip']['direct_ms_p50']:.2f} ms, sidecar "
              f"{result['round_trip']['sidecar_ms_p50']:.2f} ms", flush=True)
    finally:
        stack.stop()
    result["per_message"] = per_message(options.runs)
    print(f"added per message: p50 {result['per_message']['added_us_p50']:.0f} us, "
          f"p99 {result['per_message']['added_us_p99']:.0f} us; byte relay "
          f"{result['per_message'].get('byte_relay', {}).get('added_us_p50', float('nan')):.0f} us")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sidecar.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "sidecar.png")
    print(f"wrote {RESULTS / 'sidecar.json'} and sidecar.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
