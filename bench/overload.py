"""Overload: one tenant offering twice what a worker can serve, every request with a deadline.

Per engine (the synthetic engine at 2,000 tokens/s in all, and the embedded model, SmolLM2-135M on
the CPU), one worker with 8 slots, a queue of 8 and a queue timeout:

1. capacity (1x): 8 closed-loop clients keep every slot busy; output tokens/s and requests/s over
   the run after a warm-up, and each request's latency (its service time, nothing queued).
2. overload (2x): Poisson arrivals at twice the measured requests/s, each with a deadline (gRPC
   timeout) of the queue timeout plus twice the service time's p99.

Reported for 2x: goodput (output tokens of requests that finished inside their deadline, a second)
against the 1x capacity (target >= 0.95); how the rest ended, by status; time to refusal p50/p99 of
RESOURCE_EXHAUSTED (a full queue refuses at once, the queue timeout after it); TTFT p50/p99 of the
admitted requests (bounded by the queue timeout plus a prefill); the worker's peak RSS and whether it
lived through the run. Writes bench/results/overload.json and overload.png.

    python bench/overload.py [--engines synthetic,native] [--seconds 20] [--seed 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import machine  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
SLOTS = 8
WARMUP_S = 2.0


@dataclass(frozen=True)
class Setup:
    engine_args: tuple[str, ...]
    max_tokens: int
    queue_timeout_s: float


SETUPS = {
    "synthetic": Setup(("--engine", "synthetic", "--set", "engine.args.tokens_per_s=2000"), 64, 1.0),
    # One core for the worker, the other for this load generator, which works harder at 2x.
    "native": Setup(("--engine", "native", "--set", "engine.args.cpu_threads=1"), 32, 3.0),
}


@dataclass
class Call:
    sent: float
    first: float | None = None
    ended: float | None = None
    tokens: int = 0
    status: str = "OK"
    arrivals: list = None  # [(time, tokens)] as they came

    def __post_init__(self):
        self.arrivals = []


class Worker:
    def __init__(self, setup: Setup):
        self.dir = tempfile.mkdtemp(prefix="cyllm-overload-", dir="/tmp")
        self.socket = f"{self.dir}/w.sock"
        self.proc = subprocess.Popen(cy_llm(
            "serve", *setup.engine_args, "--socket", self.socket, "--set", f"resources.max_concurrency={SLOTS}",
            "--set", f"resources.max_queue={SLOTS}", "--set", f"resources.queue_timeout_s={setup.queue_timeout_s}",
            "--set", "server.log_level=warning"), cwd=REPO)
        wait_ready(self.socket, self.proc)

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> int | None:
        alive = self.proc.poll() is None
        self.proc.terminate()
        code = self.proc.wait(60)
        return code if alive else None


async def call(stub, pb, grpc, calls: list[Call], max_tokens: int, deadline_s: float | None) -> None:
    request = pb.PredictRequest(prompt="Write one sentence about the sea.", return_token_ids=True,
                                sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    one = Call(time.perf_counter())
    calls.append(one)
    try:
        async for reply in stub.StreamPredict(request, timeout=deadline_s):
            if reply.token_ids:
                now = time.perf_counter()
                one.first = one.first or now
                one.tokens += len(reply.token_ids)
                one.arrivals.append((now, len(reply.token_ids)))
    except grpc.aio.AioRpcError as error:
        one.status = error.code().name
    one.ended = time.perf_counter()


async def drive(socket: str, setup: Setup, seconds: float, rate: float | None, deadline_s: float | None,
                seed: int) -> list[Call]:
    """rate None: SLOTS closed-loop clients; else Poisson arrivals at `rate` a second."""
    import grpc

    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    calls: list[Call] = []
    end = time.perf_counter() + seconds
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def closed_loop() -> None:
            while time.perf_counter() < end:
                await call(stub, pb, grpc, calls, setup.max_tokens, deadline_s)

        if rate is None:
            await asyncio.gather(*(closed_loop() for _ in range(SLOTS)))
            return calls
        arrivals, sent = random.Random(seed), []
        while time.perf_counter() < end:
            sent.append(asyncio.create_task(call(stub, pb, grpc, calls, setup.max_tokens, deadline_s)))
            await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*sent)
    return calls


def window(calls: list[Call], start: float, seconds: float) -> list[Call]:
    """The calls sent after the warm-up and within the run."""
    return [c for c in calls if start + WARMUP_S <= c.sent < start + seconds]


def tokens_per_s(calls: list[Call], start: float, seconds: float) -> float:
    """Output tokens that arrived between the warm-up and the run's end, a second."""
    low, high = start + WARMUP_S, start + seconds
    return sum(n for c in calls for at, n in c.arrivals if low <= at < high) / (high - low)


def measure(name: str, setup: Setup, options) -> dict:
    worker = Worker(setup)
    try:
        start = time.perf_counter()
        loop = asyncio.run(drive(worker.socket, setup, options.seconds, None, None, options.seed))
        ok = [c for c in window(loop, start, options.seconds) if c.status == "OK"]
        capacity = {"tokens_per_s": tokens_per_s(loop, start, options.seconds),
                    "requests_per_s": len(ok) / (options.seconds - WARMUP_S),
                    "service_ms_p50": percentile([(c.ended - c.sent) * 1000 for c in ok], 50),
                    "service_ms_p99": percentile([(c.ended - c.sent) * 1000 for c in ok], 99)}
        rate = 2 * capacity["requests_per_s"]
        deadline_s = setup.queue_timeout_s + 2 * capacity["service_ms_p99"] / 1000
        start = time.perf_counter()
        every = asyncio.run(drive(worker.socket, setup, options.seconds, rate, deadline_s, options.seed))
        calls = window(every, start, options.seconds)
        rss = worker.peak_rss_mib()
    finally:
        exit_code = worker.stop()
    good = [c for c in every if c.status == "OK" and c.ended - c.sent <= deadline_s]
    refused = [c for c in calls if c.status == "RESOURCE_EXHAUSTED"]
    admitted = [c for c in calls if c.first is not None]
    statuses: dict[str, int] = {}
    for c in calls:
        statuses[c.status] = statuses.get(c.status, 0) + 1
    row = {
        "engine": name, "setup": asdict(setup), "capacity": capacity, "offered_requests_per_s": rate,
        "deadline_s": deadline_s, "requests": len(calls), "statuses": statuses,
        "goodput_tokens_per_s": tokens_per_s(good, start, options.seconds),
        "refusal_ms_p50": percentile([(c.ended - c.sent) * 1000 for c in refused], 50) if refused else None,
        "refusal_ms_p99": percentile([(c.ended - c.sent) * 1000 for c in refused], 99) if refused else None,
        "admitted_ttft_ms_p50": percentile([(c.first - c.sent) * 1000 for c in admitted], 50),
        "admitted_ttft_ms_p99": percentile([(c.first - c.sent) * 1000 for c in admitted], 99),
        "worker_peak_rss_mib": rss, "worker_survived": exit_code is not None,
    }
    row["goodput_vs_capacity"] = row["goodput_tokens_per_s"] / capacity["tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["engine"] for r in rows]
    for offset, (label, key) in zip((-0.2, 0.2), (("capacity (1x)", None), ("goodput at 2x", "goodput_tokens_per_s"))):
        values = [1.0 if key is None else r[key] / r["capacity"]["tokens_per_s"] for r in rows]
        tput.bar([i + offset for i in range(len(rows))], values, 0.38, label=label)
    tput.axhline(0.95, color="k", lw=0.8, ls="--")
    tput.set_xticks(range(len(rows)), names)
    tput.set_ylabel("output tokens/s, relative to capacity")
    tput.legend()
    for offset, (label, key) in zip((-0.2, 0.2), (("admitted TTFT p99", "admitted_ttft_ms_p99"),
                                                 ("time to refusal p99", "refusal_ms_p99"))):
        lat.bar([i + offset for i in range(len(rows))], [r[key] or 0 for r in rows], 0.38, label=label)
    lat.set_xticks(range(len(rows)), names)
    lat.set_ylabel("ms")
    lat.legend()
    fig.suptitle(f"{result['machine']['cpu']}: offered 2x capacity, deadlines", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", default="synthetic,native", help="comma-separated: synthetic, native")
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    parser.add_argument("--seed", type=int, default=5)
    options = parser.parse_args()
    rows = [measure(name, SETUPS[name], options) for name in options.engines.split(",")]
    result = {"benchmark": "overload", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "overload.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "overload.png")
    print(f"wrote {RESULTS / 'overload.json'} and overload.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
