"""Tenants sharing one synthetic worker (8 slots, 2,000 tokens/s in all), FCFS against VTC in one run.

One tenant floods: ten times the others' clients, each asking for 256 tokens against their 64. Two
scenarios, with two and with four tenants:

- backlogged: every tenant keeps more requests outstanding than its fair share of slots (closed
  loop: the flood 80 clients, each light tenant 8). Reported: each tenant's share of the tokens
  generated after a warm-up, and the total tokens/s.
- latency: each light tenant sends Poisson arrivals below its share (2/s, 32 tokens each) while the
  flood stays backlogged; the same arrivals also run with the pool to the light tenants alone.
  Reported: the light tenants' TTFT p50/p99 with the flood and alone.

Tenants are named in PredictRequest.metadata (x-gateway-inference-fairness-id), as the sidecar
forwards them. Writes bench/results/fairness.json and fairness.png.

    python bench/fairness.py [--seconds 12] [--seed 3]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import machine  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
KEY = "x-gateway-inference-fairness-id"
WARMUP_S = 2.0


class Run:
    """One worker with one policy; every stream's tenant, send time, first-token time and tokens."""

    def __init__(self, policy: str):
        self.dir = tempfile.mkdtemp(prefix="cyllm-fair-", dir="/tmp")
        self.socket = f"{self.dir}/w.sock"
        self.proc = subprocess.Popen(cy_llm(
            "serve", "--engine", "synthetic", "--socket", self.socket, "--set", "engine.args.tokens_per_s=2000",
            "--set", "resources.max_concurrency=8", "--set", "resources.queue_timeout_s=120",
            "--set", f"tenants.policy={policy}", "--set", "server.log_level=warning"), cwd=REPO)
        wait_ready(self.socket, self.proc)
        self.records: list[tuple[str, float, float | None, list[tuple[float, int]]]] = []

    async def ask(self, stub, pb, tenant: str, max_tokens: int) -> None:
        request = pb.PredictRequest(prompt="a short question of eight words here", metadata={KEY: tenant},
                                    sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        sent, first, tokens = time.perf_counter(), None, []
        async for reply in stub.StreamPredict(request):
            if reply.text:
                now = time.perf_counter()
                first = first or now
                tokens.append((now, len(reply.text)))  # the synthetic engine: one letter a token
        self.records.append((tenant, sent, first, tokens))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def drive(run: Run, tenants: list[str], scenario: str, seconds: float, seed: int, with_flood: bool = True) -> float:
    import grpc

    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    started = time.perf_counter()
    end = started + seconds
    async with grpc.aio.insecure_channel(f"unix:{run.socket}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def closed_loop(tenant: str, max_tokens: int) -> None:
            while time.perf_counter() < end:
                await run.ask(stub, pb, tenant, max_tokens)

        async def open_loop(tenant: str, rate: float, arrivals: random.Random) -> None:
            sent = []
            while time.perf_counter() < end:
                sent.append(asyncio.create_task(run.ask(stub, pb, tenant, 32)))
                await asyncio.sleep(arrivals.expovariate(rate))
            await asyncio.gather(*sent)

        flood, light = tenants[0], tenants[1:]
        clients = [closed_loop(flood, 256) for _ in range(80)] if with_flood else []
        if scenario == "backlogged":
            clients += [closed_loop(t, 64) for t in light for _ in range(8)]
        else:
            clients += [open_loop(t, 2.0, random.Random(rng.random())) for t in light]
        await asyncio.gather(*clients)
    return started


def report(run: Run, started: float, seconds: float, tenants: list[str]) -> dict:
    window = (started + WARMUP_S, started + seconds)
    tokens = {t: sum(n for tenant, _, _, ts in run.records if tenant == t for at, n in ts if window[0] <= at < window[1])
              for t in tenants}
    total = sum(tokens.values())
    ttft = {t: [(f - s) * 1000 for tenant, s, f, _ in run.records if tenant == t and f is not None and s >= window[0]]
            for t in tenants}
    return {"tokens_per_s": total / (window[1] - window[0]),
            "share": {t: tokens[t] / total if total else 0.0 for t in tenants},
            "ttft_ms": {t: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)} for t, v in ttft.items() if v}}


def measure(policy: str, count: int, scenario: str, options, with_flood: bool = True) -> dict:
    tenants = ["flood"] + [f"light{i}" for i in range(1, count)]
    run = Run(policy)
    try:
        started = asyncio.run(drive(run, tenants, scenario, options.seconds, options.seed, with_flood))
    finally:
        run.stop()
    row = {"policy": policy, "tenants": count, "scenario": scenario, "flood": with_flood,
           **report(run, started, options.seconds, tenants if with_flood else tenants[1:])}
    print(json.dumps(row), flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for count in sorted({r["tenants"] for r in rows}):
        pick = {(r["policy"], r["scenario"], r["flood"]): r for r in rows if r["tenants"] == count}
        vtc, fcfs = pick[("vtc", "backlogged", True)], pick[("fcfs", "backlogged", True)]
        equal = 1 / count
        alone, shared = pick[("vtc", "latency", False)], pick[("vtc", "latency", True)]
        lights = [t for t in shared["ttft_ms"] if t != "flood"]
        out[f"{count}_tenants"] = {
            "vtc_max_share_error": max(abs(s - equal) / equal for s in vtc["share"].values()),
            "fcfs_max_share_error": max(abs(s - equal) / equal for s in fcfs["share"].values()),
            "vtc_throughput_vs_fcfs": vtc["tokens_per_s"] / fcfs["tokens_per_s"],
            "vtc_light_ttft_p99_vs_alone": max(shared["ttft_ms"][t]["p99"] / alone["ttft_ms"][t]["p99"] for t in lights),
            "fcfs_light_ttft_p99_vs_alone": max(pick[("fcfs", "latency", True)]["ttft_ms"][t]["p99"]
                                                / alone["ttft_ms"][t]["p99"] for t in lights),
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    counts = sorted({r["tenants"] for r in rows})
    fig, axes = plt.subplots(len(counts), 2, figsize=(11, 4 * len(counts)), squeeze=False)
    for (shares, ttft), count in zip(axes, counts):
        backlogged = [r for r in rows if r["tenants"] == count and r["scenario"] == "backlogged"]
        for offset, row in zip((-0.2, 0.2), backlogged):
            names = list(row["share"])
            shares.bar([i + offset for i in range(len(names))], list(row["share"].values()), 0.38, label=row["policy"])
            shares.set_xticks(range(len(names)), names)
        shares.axhline(1 / count, color="k", lw=0.8, ls="--")
        shares.set_ylabel("share of tokens generated (backlogged)")
        shares.set_title(f"{count} tenants: token shares", fontsize=9)
        shares.legend()
        latency = [r for r in rows if r["tenants"] == count and r["scenario"] == "latency"]
        labels = [f"{r['policy']}\n{'with flood' if r['flood'] else 'alone'}" for r in latency]
        ttft.bar(labels, [max(v["p99"] for t, v in r["ttft_ms"].items() if t != "flood") for r in latency])
        ttft.set_ylabel("light tenants' TTFT p99, ms")
        ttft.set_yscale("log")
        ttft.set_title(f"{count} tenants: light tenants' TTFT", fontsize=9)
    fig.suptitle(result["machine"]["cpu"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=12.0, help="each run's length")
    parser.add_argument("--seed", type=int, default=3)
    options = parser.parse_args()
    rows = []
    for count in (2, 4):
        for scenario in ("backlogged", "latency"):
            for policy in ("fcfs", "vtc"):
                rows.append(measure(policy, count, scenario, options))
        rows.append(measure("vtc", count, "latency", options, with_flood=False))
    result = {"benchmark": "fairness", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "rows": rows, "summary": summary(rows)}
    print(json.dumps(result["summary"], indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fairness.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "fairness.png")
    print(f"wrote {RESULTS / 'fairness.json'} and fairness.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
