"""Tenants sharing one worker (8 slots), FCFS against VTC (and VTC with headroom) in one run.

The synthetic engine as a batched one (a token for every running request each 10 ms step) by
default; --engine native runs the embedded model (SmolLM2-135M, ~25 ms steps) with longer runs.
One tenant floods: ten times the others' clients, each asking for 4x their tokens (64 against
16). Two scenarios, with two and with four tenants:

- backlogged: every tenant keeps more requests outstanding than its fair share of slots (closed
  loop: the flood 80 clients, each light tenant 8). Reported: each tenant's share of the tokens
  generated after a warm-up, and the total tokens/s.
- latency: each light tenant sends Poisson arrivals well below its share (8 tokens each; synthetic
  1/s, native 0.5/s) while the flood stays backlogged; the same arrivals also run with the pool to
  the light tenants alone. Reported: the light tenants' TTFT p50/p99 (all light tenants' requests
  together) with the flood and alone.

Policies: fcfs, vtc, and vtc+headroom (tenants.headroom_slots=3: the last three free slots go only
to tenants holding less than their share, since admission cannot preempt a running request; three,
so that three light tenants' requests in flight at once, as Poisson arrivals sometimes are, still
start at once).

Tenants are named in PredictRequest.metadata (x-gateway-inference-fairness-id), as the sidecar
forwards them. Writes bench/results/fairness.json and fairness.png (fairness-native.* for native).

    python bench/fairness.py [--engine synthetic|native] [--seconds 40] [--seed 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import machine  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
KEY = "x-gateway-inference-fairness-id"
WARMUP_S = 2.0


@dataclass(frozen=True)
class Workload:
    engine_args: tuple[str, ...]
    flood_tokens: int
    light_tokens: int
    latency_tokens: int
    latency_rate: float
    """Each light tenant's arrivals a second in the latency scenario."""
    seconds: float


WORKLOADS = {
    "synthetic": Workload(("--engine", "synthetic", "--set", "engine.args.step_ms=10"), 64, 16, 8, 1.0, 40.0),
    "native": Workload(("--engine", "native", "--set", "engine.args.cpu_threads=2"), 64, 16, 8, 0.5, 60.0),
}
POLICIES = {"fcfs": ("--set", "tenants.policy=fcfs"), "vtc": ("--set", "tenants.policy=vtc"),
            "vtc+headroom": ("--set", "tenants.policy=vtc", "--set", "tenants.headroom_slots=3")}


class Run:
    """One worker with one policy; every stream's tenant, send time, first-token time and tokens."""

    def __init__(self, policy: str, workload: Workload):
        self.dir = tempfile.mkdtemp(prefix="cyllm-fair-", dir="/tmp")
        self.socket = f"{self.dir}/w.sock"
        self.proc = subprocess.Popen(cy_llm(
            "serve", *workload.engine_args, "--socket", self.socket,
            "--set", "resources.max_concurrency=8", "--set", "resources.queue_timeout_s=300",
            *POLICIES[policy], "--set", "server.log_level=warning"), cwd=REPO)
        wait_ready(self.socket, self.proc)
        self.records: list[list] = []

    async def ask(self, stub, pb, tenant: str, max_tokens: int) -> None:
        request = pb.PredictRequest(prompt="a short question of eight words here", metadata={KEY: tenant},
                                    sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                               temperature=0.0),
                                    return_token_ids=True)
        entry = [tenant, time.perf_counter(), None, []]  # tenant, sent, first token, [(at, tokens)]
        self.records.append(entry)  # now, so a stream cut at the run's end still counts what it got
        async for reply in stub.StreamPredict(request):
            if reply.token_ids:
                now = time.perf_counter()
                entry[2] = entry[2] or now
                entry[3].append((now, len(reply.token_ids)))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def drive(run: Run, tenants: list[str], scenario: str, workload: Workload, seed: int,
                with_flood: bool = True) -> float:
    import grpc

    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    started = time.perf_counter()
    end = started + workload.seconds
    async with grpc.aio.insecure_channel(f"unix:{run.socket}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def closed_loop(tenant: str, max_tokens: int) -> None:
            while time.perf_counter() < end:
                await run.ask(stub, pb, tenant, max_tokens)

        async def open_loop(tenant: str, rate: float, arrivals: random.Random) -> None:
            sent = []
            try:
                while time.perf_counter() < end:
                    sent.append(asyncio.create_task(run.ask(stub, pb, tenant, workload.latency_tokens)))
                    await asyncio.sleep(arrivals.expovariate(rate))
                await asyncio.gather(*sent)
            finally:
                for task in sent:
                    task.cancel()

        flood, light = tenants[0], tenants[1:]
        clients = [closed_loop(flood, workload.flood_tokens) for _ in range(80)] if with_flood else []
        if scenario == "backlogged":
            clients += [closed_loop(t, workload.light_tokens) for t in light for _ in range(8)]
        else:
            clients += [open_loop(t, workload.latency_rate, random.Random(rng.random())) for t in light]
        # At the end every stream still open is cut, not drained: a backlog would take minutes.
        tasks = [asyncio.create_task(c) for c in clients]
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return started


def report(run: Run, started: float, seconds: float, tenants: list[str]) -> dict:
    window = (started + WARMUP_S, started + seconds)
    tokens = {t: sum(n for tenant, _, _, ts in run.records if tenant == t for at, n in ts if window[0] <= at < window[1])
              for t in tenants}
    total = sum(tokens.values())
    ttft = {t: [(f - s) * 1000 for tenant, s, f, _ in run.records if tenant == t and f is not None and s >= window[0]]
            for t in tenants}
    lights = [ms for t, v in ttft.items() if t != "flood" for ms in v]
    return {"tokens_per_s": total / (window[1] - window[0]),
            "share": {t: tokens[t] / total if total else 0.0 for t in tenants},
            "ttft_ms": {t: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)} for t, v in ttft.items() if v},
            # Every light tenant's requests together: p99 wants more samples than one tenant sends.
            "lights_ttft_ms": {"p50": percentile(lights, 50), "p99": percentile(lights, 99), "n": len(lights)}
            if lights else None}


def measure(policy: str, count: int, scenario: str, workload: Workload, seed: int, with_flood: bool = True) -> dict:
    tenants = ["flood"] + [f"light{i}" for i in range(1, count)]
    run = Run(policy, workload)
    try:
        started = asyncio.run(drive(run, tenants, scenario, workload, seed, with_flood))
    finally:
        run.stop()
    row = {"policy": policy, "tenants": count, "scenario": scenario, "flood": with_flood,
           **report(run, started, workload.seconds, tenants if with_flood else tenants[1:])}
    print(json.dumps(row), flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for count in sorted({r["tenants"] for r in rows}):
        pick = {(r["policy"], r["scenario"], r["flood"]): r for r in rows if r["tenants"] == count}
        fcfs, equal = pick[("fcfs", "backlogged", True)], 1 / count
        alone = pick[("vtc", "latency", False)]
        lights = [t for t in alone["ttft_ms"] if t != "flood"]
        lights_alone = alone["lights_ttft_ms"]
        one = {}
        for policy in ("fcfs", "vtc", "vtc+headroom"):
            backlogged, shared = pick[(policy, "backlogged", True)], pick[(policy, "latency", True)]
            one[policy] = {
                "max_share_error": max(abs(s - equal) / equal for s in backlogged["share"].values()),
                "throughput_vs_fcfs": backlogged["tokens_per_s"] / fcfs["tokens_per_s"],
                # None: a light tenant never got a first token before the run ended (starved).
                "light_ttft_p99_vs_alone": None if any(t not in shared["ttft_ms"] for t in lights) else
                shared["lights_ttft_ms"]["p99"] / lights_alone["p99"],
                "light_ttft_p99_ms": None if shared["lights_ttft_ms"] is None else shared["lights_ttft_ms"]["p99"],
                "light_ttft_p99_alone_ms": lights_alone["p99"],
            }
        out[f"{count}_tenants"] = one
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
        for offset, row in zip((-0.27, 0, 0.27), backlogged):
            names = list(row["share"])
            shares.bar([i + offset for i in range(len(names))], list(row["share"].values()), 0.26, label=row["policy"])
            shares.set_xticks(range(len(names)), names)
        shares.axhline(1 / count, color="k", lw=0.8, ls="--")
        shares.set_ylabel("share of tokens generated (backlogged)")
        shares.set_title(f"{count} tenants: token shares", fontsize=9)
        shares.legend()
        latency = [r for r in rows if r["tenants"] == count and r["scenario"] == "latency"]
        labels = [f"{r['policy']}\n{'with flood' if r['flood'] else 'alone'}" for r in latency]
        # A light tenant with no first token in the whole run (starved) is drawn at the run's length.
        starved = result["workload"]["seconds"] * 1000
        ttft.bar(labels, [r["lights_ttft_ms"]["p99"] if r["lights_ttft_ms"] else starved for r in latency])
        ttft.set_ylabel("light tenants' TTFT p99, ms (starved: run length)")
        ttft.set_yscale("log")
        ttft.set_title(f"{count} tenants: light tenants' TTFT", fontsize=9)
    fig.suptitle(result["machine"]["cpu"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=sorted(WORKLOADS), default="synthetic")
    parser.add_argument("--seconds", type=float, help="each run's length (synthetic 40, native 60)")
    parser.add_argument("--seed", type=int, default=3)
    options = parser.parse_args()
    workload = WORKLOADS[options.engine]
    if options.seconds:
        workload = dataclasses.replace(workload, seconds=options.seconds)
    rows = []
    for count in (2, 4):
        for scenario in ("backlogged", "latency"):
            for policy in POLICIES:
                rows.append(measure(policy, count, scenario, workload, options.seed))
        rows.append(measure("vtc", count, "latency", workload, options.seed, with_flood=False))
    result = {"benchmark": "fairness", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "workload": dataclasses.asdict(workload), "rows": rows, "summary": summary(rows)}
    print(json.dumps(result["summary"], indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "fairness" if options.engine == "synthetic" else f"fairness-{options.engine}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
