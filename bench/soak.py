"""Soak: many requests through the sidecar to two synthetic workers, with random cancels and
deadlines, and one worker killed with SIGKILL and restarted midway.

Checks what DESIGN.md promises: every request ends (a finished stream or one status), nothing is
left held at the end (GetLoad, the engine's own count, the sidecar's active streams), the surviving
worker's memory and file descriptors stay flat. Writes bench/results/reliability.json and .png.

    python bench/soak.py [--requests 100000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.sidecar import free_port, sidecar_binary  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb  # noqa: E402
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = REPO / "bench" / "results"
WORKER_ARGS = ["--engine", "synthetic", "--set", "engine.args.tokens_per_s=200000", "--set", "resources.max_concurrency=64",
               "--set", "resources.max_queue=512", "--set", "server.log_level=warning"]


def start_worker(socket: str) -> subprocess.Popen:
    proc = subprocess.Popen(cy_llm("serve", "--socket", socket, *WORKER_ARGS), cwd=REPO)
    wait_ready(socket, proc)
    return proc


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def worker_state(socket: str) -> dict:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        control = pb_grpc.WorkerControlStub(channel)
        load = control.GetLoad(pb.GetLoadRequest(), timeout=5)
        text = control.Metrics(pb.MetricsRequest(), timeout=5).text
    unfinished = float(re.search(r"^cyllm_engine_unfinished_requests (\S+)$", text, re.M).group(1))
    return {"running": load.running, "queued": load.queued, "budget_tokens_used": load.budget_tokens_used,
            "engine_unfinished": unfinished}


def sidecar_active(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r"^cyllm_sidecar_active_streams (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def one(stub, rng: random.Random, outcomes: collections.Counter) -> None:
    request = pb.PredictRequest(prompt="soak", sampling=pb.SamplingParams(max_tokens=rng.randint(1, 32), ignore_eos=True))
    timeout = rng.choice([None, None, None, rng.uniform(0.001, 0.2)])
    call = stub.StreamPredict(request, timeout=timeout)
    # One in five is cancelled: before anything arrives, or after its first message.
    cancel_after = rng.randint(0, 1) if rng.random() < 0.2 else None
    messages = 0
    if cancel_after == 0:
        call.cancel()
        outcomes["CANCELLED_BY_CLIENT"] += 1
        return
    try:
        async for _ in call:
            messages += 1
            if cancel_after is not None and messages >= cancel_after:
                call.cancel()
                outcomes["CANCELLED_BY_CLIENT"] += 1
                return
        outcomes["OK"] += 1
    except grpc.aio.AioRpcError as error:
        outcomes[error.code().name] += 1
    except asyncio.CancelledError:
        outcomes["CANCELLED_BY_CLIENT"] += 1


async def drive(target: str, total: int, concurrency: int, on_half) -> tuple[collections.Counter, int, float]:
    outcomes: collections.Counter = collections.Counter()
    rng = random.Random(7)
    started = time.perf_counter()
    issued = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def lane() -> None:
            nonlocal issued
            while issued < total:
                issued += 1
                if issued == total // 2:
                    await asyncio.to_thread(on_half)
                await one(stub, rng, outcomes)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return outcomes, issued, time.perf_counter() - started


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes = sorted(result["outcomes"].items(), key=lambda item: -item[1])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([name for name, _ in outcomes], [count for _, count in outcomes])
    ax.set_yscale("log")
    ax.set_ylabel("requests")
    ax.set_title(f"{result['requests']:,} requests, {result['without_an_ending']} without an ending; "
                 f"RSS +{result['survivor_rss_mb']['growth']:.1f} MB")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    binary = sidecar_binary()
    folder = Path(os.path.realpath(f"/tmp/cyllm-soak-{os.getpid()}"))
    folder.mkdir()
    sockets = [str(folder / "w0.sock"), str(folder / "w1.sock")]
    workers = [start_worker(s) for s in sockets]
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    sidecar = subprocess.Popen([str(binary), *(f"--worker=unix://{s}" for s in sockets), "--grpc-addr", f"127.0.0.1:{grpc_port}",
                                "--http-addr", f"127.0.0.1:{http_port}", "--metrics-addr", f"127.0.0.1:{metrics_port}",
                                "--log", "warn", "--max-streams", "4096"])
    events = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.1)  # the sidecar is starting; /readyz is the only signal
        survivor = workers[0].pid
        asyncio.run(drive(f"127.0.0.1:{grpc_port}", 2000, args.concurrency, lambda: None))  # warm-up
        before = {"rss_mb": rss_mb(survivor), "fds": fds(survivor)}

        def kill_and_restart() -> None:
            workers[1].send_signal(signal.SIGKILL)
            workers[1].wait()
            events.append({"at": time.time(), "event": "worker w1 killed with SIGKILL"})
            time.sleep(1)  # traffic runs on one worker for a while, as after a real crash
            workers[1] = start_worker(sockets[1])  # replaces the stale socket
            events.append({"at": time.time(), "event": "worker w1 restarted"})

        outcomes, issued, wall = asyncio.run(drive(f"127.0.0.1:{grpc_port}", args.requests, args.concurrency, kill_and_restart))
        time.sleep(2)  # handlers release in their finally blocks; the sidecar's poll catches up
        after = {"rss_mb": rss_mb(survivor), "fds": fds(survivor)}
        states = {f"w{i}": worker_state(s) for i, s in enumerate(sockets)}
        active = sidecar_active(metrics_port)
    finally:
        for proc in (sidecar, *workers):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    ended = sum(outcomes.values())
    leaked = any(v for state in states.values() for v in state.values()) or active != 0
    result = {
        "benchmark": "reliability", "machine": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d %H:%M"),
        "requests": issued, "ended": ended, "without_an_ending": issued - ended, "wall_s": wall,
        "requests_per_s": issued / wall, "outcomes": dict(outcomes), "events": events,
        "end_state": {"workers": states, "sidecar_active_streams": active},
        "survivor_rss_mb": {"before": before["rss_mb"], "after": after["rss_mb"], "growth": after["rss_mb"] - before["rss_mb"]},
        "survivor_fds": {"before": before["fds"], "after": after["fds"]},
        "passed": issued == ended and not leaked and after["rss_mb"] - before["rss_mb"] < 50 and after["fds"] <= before["fds"] + 4,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reliability.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "reliability.png")
    print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
