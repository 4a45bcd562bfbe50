"""Tenants sharing one worker (8 slots), FCFS against VTC (with headroom, with burst), in one run.

The synthetic engine as a batched one (a token for every running request each 10 ms step) by
default; --engine native runs the embedded model (SmolLM2-135M, ~20 ms steps), speculation off:
its gain depends on how long each stream has been repeating itself, so it would weigh the
policies' request mixes rather than the scheduler. One tenant floods: ten times the others'
clients, each asking for 4x their tokens (64 against 16). Two scenarios, with two and with four
tenants:

- backlogged: every tenant keeps more requests outstanding than its fair share of slots (closed
  loop: the flood 80 clients, each light tenant 8). Reported: each tenant's share of the service
  after a warm-up as VTC counts it (prompt tokens weighted 1, generated tokens 2: a light request
  pays its prompt for 16 tokens, a flood request for 64) and of the tokens generated alone, the
  total tokens/s, and requests finished per 1,000 tokens: a
  request costs its prompt and its work on the worker's event loop (and, where an engine cannot
  refill an ended row in the next step, a step with that slot empty), which the fair mix, of 2-4x
  FCFS's requests per token, pays more often.
- latency: each light tenant sends Poisson arrivals well below its share (8 tokens each; synthetic
  1/s, native 0.5/s, native on CUDA 2/s, or --latency-rate) while the flood stays backlogged; the same arrivals also run with the pool to
  the light tenants alone. Reported: the light tenants' TTFT p50/p99 (all light tenants' requests
  of every round together) with the flood and alone.

Policies: fcfs, vtc, vtc+headroom (tenants.headroom_slots=3: the last three free slots go only to
tenants holding less than their share, since admission cannot preempt a running request; three, so
that three light tenants' requests in flight at once, as Poisson arrivals sometimes are, still start
at once) and vtc+burst (tenants.burst_slots=3, or --burst-slots: slots above the eight, only for
those tenants, so the flood keeps all eight; three light tenants at 2/s each have six in flight at
times). Every round runs each policy once, in turn, so a shared machine's slow spell falls on all
of them; throughput is the median over rounds of each round's ratio to FCFS.

Tenants are named in PredictRequest.metadata (x-gateway-inference-fairness-id), as the sidecar
forwards them. Writes bench/results/fairness.json and fairness.png (fairness-native.* for native).

Each policy also reports the flood's median step (the gap between its streams' tokens in the
latency runs): a light request started at once still waits out the step in flight, so where the
engine is idle between the light tenants' requests alone, their TTFT with the flood is about one
such step longer whatever the policy does (docs/benchmarks.md).

    python bench/fairness.py [--engine synthetic|native] [--device cpu|cuda] [--model NAME|FOLDER]
                             [--policies fcfs,vtc,...] [--seconds S] [--rounds N] [--seed 3]
                             [--tenants 2,4] [--burst-slots 3] [--name FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import drawn_at_random, machine  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.config import TenantsConfig  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
PROMPT_WEIGHT, OUTPUT_WEIGHT = TenantsConfig.prompt_weight, TenantsConfig.output_weight
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
    rounds: int
    burst_slots: int = 3
    """vtc+burst's tenants.burst_slots: size it for the light tenants' requests in flight at once."""


WORKLOADS = {
    "synthetic": Workload(("--engine", "synthetic", "--set", "engine.args.step_ms=10"), 64, 16, 8, 1.0, 40.0, 1),
    "native": Workload(("--engine", "native", "--set", "engine.args.cpu_threads=2", "--set", "engine.args.speculation=off"),
                       64, 16, 8, 0.5, 30.0, 3),
}
POLICIES = {"fcfs": ("--set", "tenants.policy=fcfs"), "vtc": ("--set", "tenants.policy=vtc"),
            "vtc+headroom": ("--set", "tenants.policy=vtc", "--set", "tenants.headroom_slots=3"),
            "vtc+burst": ("--set", "tenants.policy=vtc")}  # and tenants.burst_slots=Workload.burst_slots
# --device cuda: the embedded model in bf16 on the GPU (CUDA graphs, launch-ahead), its steps ~10x
# shorter than on a CPU, so the light tenants ask 4x as often (still far under their share) and
# their p99 rests on more requests.
CUDA_ARGS = ("--engine", "native", "--set", "engine.device=cuda", "--set", "engine.dtype=bfloat16",
             "--set", "engine.args.speculation=off")
CUDA_LATENCY_RATE = 2.0


class Run:
    """One worker with one policy; every stream's tenant, send time, first-token time and tokens."""

    def __init__(self, policy: str, workload: Workload):
        self.dir = tempfile.mkdtemp(prefix="cyllm-fair-", dir="/tmp")
        self.socket = f"{self.dir}/w.sock"
        burst = ("--set", f"tenants.burst_slots={workload.burst_slots}") if policy == "vtc+burst" else ()
        self.proc = subprocess.Popen(cy_llm(
            "serve", *workload.engine_args, "--socket", self.socket,
            "--set", "resources.max_concurrency=8", "--set", "resources.queue_timeout_s=300",
            *POLICIES[policy], *burst, "--set", "server.log_level=warning"), cwd=REPO)
        wait_ready(self.socket, self.proc)
        self.records: list[list] = []
        self.prompt_tokens = 0  # every request's (one prompt), from a finished one's usage

    async def ask(self, stub, pb, tenant: str, max_tokens: int) -> None:
        request = pb.PredictRequest(prompt="a short question of eight words here", metadata={KEY: tenant},
                                    sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                               temperature=0.0),
                                    return_token_ids=True)
        entry = [tenant, time.perf_counter(), None, [], max_tokens]  # tenant, sent, first token, [(at, tokens)], asked
        self.records.append(entry)  # now, so a stream cut at the run's end still counts what it got
        async for reply in stub.StreamPredict(request):
            if reply.token_ids:
                now = time.perf_counter()
                entry[2] = entry[2] or now
                entry[3].append((now, len(reply.token_ids)))
            self.prompt_tokens = reply.usage.prompt_tokens or self.prompt_tokens

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
    tokens = {t: sum(n for tenant, _, _, ts, _ in run.records if tenant == t for at, n in ts if window[0] <= at < window[1])
              for t in tenants}
    total = sum(tokens.values())
    # A request finished in the window: its stream got all its tokens before the run's end cut it.
    finished = sum(1 for _, _, _, ts, asked in run.records
                   if ts and window[0] <= ts[-1][0] < window[1] and sum(n for _, n in ts) == asked)
    ttft = {t: [(f - s) * 1000 for tenant, s, f, _, _ in run.records if tenant == t and f is not None and s >= window[0]]
            for t in tenants}
    # The service VTC counts: prompt tokens at admission (here: requests started in the window)
    # and generated ones, weighted as the worker's defaults weigh them.
    started_here = {t: sum(1 for tenant, _, f, _, _ in run.records if tenant == t and f is not None and window[0] <= f < window[1])
                    for t in tenants}
    service = {t: PROMPT_WEIGHT * run.prompt_tokens * started_here[t] + OUTPUT_WEIGHT * tokens[t] for t in tenants}
    prompts = run.prompt_tokens * sum(started_here.values())
    return {"tokens_per_s": total / (window[1] - window[0]),
            "processed_tokens_per_s": (total + prompts) / (window[1] - window[0]),
            "share": {t: tokens[t] / total if total else 0.0 for t in tenants},
            "service_share": {t: service[t] / sum(service.values()) if total else 0.0 for t in tenants},
            "prompt_tokens": run.prompt_tokens,
            "requests_per_1k_tokens": 1000 * finished / total if total else None,
            "ttft_samples_ms": ttft}


def flood_step_ms(run: Run, started: float, seconds: float) -> float | None:
    """The median gap between tokens of the flood's streams in the window: its step."""
    gaps = [(ts[-1][0] - ts[0][0]) * 1000 / (sum(n for _, n in ts) - ts[0][1])
            for tenant, _, _, ts, _ in run.records
            if tenant == "flood" and len(ts) > 1 and started + WARMUP_S <= ts[0][0] and ts[-1][0] < started + seconds]
    return statistics.median(gaps) if gaps else None


def measure(policy: str, count: int, scenario: str, workload: Workload, seed: int, round_: int,
            with_flood: bool = True) -> dict:
    tenants = ["flood"] + [f"light{i}" for i in range(1, count)]
    run = Run(policy, workload)
    try:
        started = asyncio.run(drive(run, tenants, scenario, workload, seed + 1000 * round_, with_flood))
    finally:
        run.stop()
    row = {"policy": policy, "tenants": count, "scenario": scenario, "flood": with_flood, "round": round_,
           **report(run, started, workload.seconds, tenants if with_flood else tenants[1:]),
           "flood_step_ms": flood_step_ms(run, started, workload.seconds)}
    print(json.dumps({k: v for k, v in row.items() if k != "ttft_samples_ms"}), flush=True)
    return row


def ttft(rows: list[dict]) -> dict:
    """TTFT p50/p99 per tenant and of every light tenant together, over all rounds' samples."""
    samples: dict[str, list[float]] = {}
    for row in rows:
        for tenant, values in row["ttft_samples_ms"].items():
            samples.setdefault(tenant, []).extend(values)
    lights = [ms for t, v in samples.items() if t != "flood" for ms in v]
    stats = lambda v: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)}  # noqa: E731
    return {"per_tenant": {t: stats(v) for t, v in samples.items() if v}, "lights": stats(lights) if lights else None}


def summary(rows: list[dict], policies: list[str]) -> dict:
    out = {}
    for count in sorted({r["tenants"] for r in rows}):
        pick = lambda policy, scenario, flood=True: [  # noqa: E731
            r for r in rows if (r["tenants"], r["policy"], r["scenario"], r["flood"]) == (count, policy, scenario, flood)]
        fcfs, equal = {r["round"]: r for r in pick("fcfs", "backlogged")}, 1 / count
        fcfs_latency = {r["round"]: r for r in pick("fcfs", "latency")}
        alone = ttft(pick(policies[-1], "latency", False))
        one = {}
        for policy in policies:
            backlogged, shared = pick(policy, "backlogged"), ttft(pick(policy, "latency"))
            steps = [r["flood_step_ms"] for r in pick(policy, "latency") if r["flood_step_ms"]]
            light_names = [t for t in alone["per_tenant"] if t != "flood"]
            one[policy] = {
                # Of the service the policy shares (weighted prompt and generated tokens), and of
                # the generated tokens alone: a tenant of short requests pays more prompt a token.
                "max_share_error": statistics.median(max(abs(s - equal) / equal for s in r["service_share"].values())
                                                     for r in backlogged),
                "max_generated_share_error": statistics.median(max(abs(s - equal) / equal for s in r["share"].values())
                                                               for r in backlogged),
                "throughput_vs_fcfs": statistics.median(r["tokens_per_s"] / fcfs[r["round"]]["tokens_per_s"]
                                                        for r in backlogged),
                "throughput_vs_fcfs_rounds": [r["tokens_per_s"] / fcfs[r["round"]]["tokens_per_s"] for r in backlogged],
                # Prompt tokens counted as served too: the fair mix's more numerous requests each pay one.
                "processed_vs_fcfs": statistics.median(
                    r["processed_tokens_per_s"] / fcfs[r["round"]]["processed_tokens_per_s"] for r in backlogged),
                # With the light tenants under their share: what slots held for them cost the flood.
                "latency_throughput_vs_fcfs": statistics.median(
                    r["tokens_per_s"] / fcfs_latency[r["round"]]["tokens_per_s"] for r in pick(policy, "latency")),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in backlogged),
                "requests_per_1k_tokens": statistics.median(r["requests_per_1k_tokens"] for r in backlogged),
                "ttft_ms_backlogged": ttft(backlogged)["per_tenant"],
                # None: a light tenant never got a first token (starved).
                "light_ttft_p99_vs_alone": None if any(t not in shared["per_tenant"] for t in light_names) else
                shared["lights"]["p99"] / alone["lights"]["p99"],
                "light_ttft_ms": shared["lights"],
                "light_ttft_ms_alone": alone["lights"],
                "flood_step_ms": statistics.median(steps) if steps else None,
            }
        out[f"{count}_tenants"] = one
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, policies = result["summary"], result["options"]["policies"]
    counts = sorted(int(key.split("_")[0]) for key in summary)
    fig, axes = plt.subplots(len(counts), 2, figsize=(11, 4 * len(counts)), squeeze=False)
    for (shares, latency), count in zip(axes, counts):
        backlogged = [r for r in result["rows"] if r["tenants"] == count and r["scenario"] == "backlogged"]
        for offset, policy in zip((-0.3, -0.1, 0.1, 0.3), policies):
            runs = [r for r in backlogged if r["policy"] == policy]
            names = list(runs[0]["service_share"])
            means = [statistics.mean(r["service_share"][n] for r in runs) for n in names]
            ratio = summary[f"{count}_tenants"][policy]["throughput_vs_fcfs"]
            shares.bar([i + offset for i in range(len(names))], means, 0.2, label=f"{policy} ({ratio:.2f}x FCFS tok/s)")
            shares.set_xticks(range(len(names)), names)
        shares.axhline(1 / count, color="k", lw=0.8, ls="--")
        shares.set_ylabel("share of service, VTC's weighted tokens (backlogged)")
        shares.set_title(f"{count} tenants: token shares, mean of {result['workload']['rounds']} rounds", fontsize=9)
        shares.legend(fontsize=8)
        one = summary[f"{count}_tenants"]
        starved = result["workload"]["seconds"] * 1000  # a light tenant with no first token: the run's length
        labels = [*(f"{p}\nwith flood" for p in policies), "alone"]
        values = [one[p]["light_ttft_ms"]["p99"] if one[p]["light_ttft_ms"] else starved for p in policies]
        latency.bar(labels, values + [one[policies[-1]]["light_ttft_ms_alone"]["p99"]])
        latency.set_ylabel("light tenants' TTFT p99, ms (starved: run length)")
        latency.set_yscale("log")
        latency.set_title(f"{count} tenants: light tenants' TTFT", fontsize=9)
    fig.suptitle(result["machine"].get("gpu", result["machine"]["cpu"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=sorted(WORKLOADS), default="synthetic")
    parser.add_argument("--seconds", type=float, help="each run's length (synthetic 40, native 30)")
    parser.add_argument("--rounds", type=int, help="rounds of every policy (synthetic 1, native 3)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="native only")
    parser.add_argument("--model", help="native only: model name or folder (default the embedded model)")
    parser.add_argument("--tenants", default="2,4", help="tenant counts to run (comma-separated)")
    parser.add_argument("--name", help="the results' file name (default fairness[-ENGINE][-cuda])")
    parser.add_argument("--latency-rate", type=float,
                        help="each light tenant's arrivals a second in the latency scenario (synthetic 1, native 0.5, "
                             "--device cuda 2): more samples make the p99 more than the slowest of a few dozen")
    parser.add_argument("--burst-slots", type=int, help="vtc+burst's tenants.burst_slots (default 3)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, FCFS first (the ratios' base); alone runs with the last")
    options = parser.parse_args()
    options.policies = options.policies.split(",")
    if options.policies[0] != "fcfs" or not set(options.policies) <= set(POLICIES):
        parser.error(f"--policies: fcfs first, then any of {', '.join(POLICIES)}")
    if options.engine != "native" and (options.device != "cpu" or options.model):
        parser.error("--device and --model are for --engine native")
    workload = WORKLOADS[options.engine]
    if options.device == "cuda":
        workload = dataclasses.replace(workload, engine_args=CUDA_ARGS, latency_rate=CUDA_LATENCY_RATE)
    if options.model:
        workload = dataclasses.replace(workload, engine_args=(*workload.engine_args, "--model", options.model))
    if options.seconds:
        workload = dataclasses.replace(workload, seconds=options.seconds)
    if options.rounds:
        workload = dataclasses.replace(workload, rounds=options.rounds)
    if options.latency_rate:
        workload = dataclasses.replace(workload, latency_rate=options.latency_rate)
    if options.burst_slots:
        workload = dataclasses.replace(workload, burst_slots=options.burst_slots)
    rows = []
    for count in [int(c) for c in options.tenants.split(",")]:
        for round_ in range(workload.rounds):
            for scenario in ("backlogged", "latency"):
                for policy in options.policies:
                    rows.append(measure(policy, count, scenario, workload, options.seed, round_))
            rows.append(measure(options.policies[-1], count, "latency", workload, options.seed, round_,
                                with_flood=False))
    # Each run's TTFTs as percentiles; the summary pools every round's samples.
    runs = [{**{k: v for k, v in row.items() if k != "ttft_samples_ms"}, "ttft_ms": ttft([row])["per_tenant"]}
            for row in rows]
    result = {"benchmark": "fairness", "machine": machine(options.device), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "random_weights": bool(options.model) and drawn_at_random(Path(options.model)),
              "workload": dataclasses.asdict(workload), "rows": runs, "summary": summary(rows, options.policies)}
    print(json.dumps(result["summary"], indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = options.name or ("fairness" if options.engine == "synthetic" else f"fairness-{options.engine}")
    name += "-cuda" if options.device == "cuda" and not options.name else ""
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
