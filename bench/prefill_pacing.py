"""How long the native engine's prefill chunks take against the PrefillPacer's target as a long
prompt's context grows: the pacer as it ships (attention's FLOPs weighed as the recent steps say)
against every FLOP priced alike (the rule before: WEIGHTS pinned to 1), each run an engine in a
process of its own, the rules alternated round by round, the same prompt in a round. A chunk past
its target is what an abort, a deadline or another stream's next token waits for beyond it; a
chunk under it costs the prompt steps, so the time to its first token is reported beside.

The embedded model by default (a 7,800-token prompt of its 8,192); --model takes a folder (on a CUDA
GPU, in bf16). The engine's own token budget a step (2,048). Writes
bench/results/prefill_pacing[_cuda].json and .png.

    python bench/prefill_pacing.py [--model FOLDER] [--tokens 7800] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.native_burst import DEVICE, engine_for, run_requests, unload  # noqa: E402
from bench.structured import drawn_at_random, machine  # noqa: E402
from worker.engines.native import pacer as pacing  # noqa: E402

RESULTS = REPO / "bench" / "results"
EMBEDDED = "smollm2-135m-instruct"  # the embedded model, by its name (prepared on first use)
RULES = {"weighted": pacing.WEIGHTS, "alike": np.ones(1)}


def recorded(engine) -> list[dict]:
    """Each prefill step's (cached tokens, chunk, seconds), as the engine's pacer sees them."""
    steps: list[dict] = []
    pacer = engine.pacer
    chunk, record = pacer.chunk, pacer.record

    def chunked(cached, remaining, budget, step, first=True):
        tokens = chunk(cached, remaining, budget, step, first)
        steps.append({"cached": cached, "chunk": tokens})
        return tokens

    def measured(work, seconds, prefill_tokens):
        record(work, seconds, prefill_tokens)
        if steps and "seconds" not in steps[-1]:
            steps[-1].update(seconds=round(seconds, 4), weight=round(pacer.weight, 3))

    pacer.chunk, pacer.record = chunked, measured
    return steps


def summary(runs: list[dict], target: float) -> dict:
    """Of every chunk but each prompt's last (what was left): seconds over the target, by the
    context's quarter of the prompt, and the time to the first token."""
    out = {}
    for rule in RULES:
        chunks = [(s["cached"] / run["tokens"], s["seconds"] / target) for run in runs if run["rule"] == rule
                  for s in run["steps"][:-1]]
        quarters = [[over for at, over in chunks if q / 4 <= at < (q + 1) / 4] for q in range(4)]
        ttfts = [run["ttft_s"] for run in runs if run["rule"] == rule]
        out[rule] = {"over_target_median": statistics.median(o for _, o in chunks),
                     "over_target_max": max(o for _, o in chunks),
                     "over_target_median_by_quarter": [statistics.median(q) if q else None for q in quarters],
                     "steps_median": statistics.median(len(run["steps"]) for run in runs if run["rule"] == rule),
                     "ttft_s_median": statistics.median(ttfts), "ttft_s_runs": ttfts}
    out["ttft_ratio_weighted_over_alike"] = out["weighted"]["ttft_s_median"] / out["alike"]["ttft_s_median"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4))
    last = {run["rule"]: run for run in result["runs"]}
    for rule, label in (("alike", "every FLOP priced alike (before)"), ("weighted", "attention weighed (now)")):
        steps = last[rule]["steps"][:-1]
        axis.plot([s["cached"] for s in steps], [s["seconds"] for s in steps], marker=".", label=label)
    axis.axhline(result["target_s"], color="gray", linestyle="--", label="the pacer's target")
    axis.set_xlabel("tokens of the prompt already in the cache")
    axis.set_ylabel("the step's seconds")
    axis.legend(fontsize=8)
    axis.set_title(f"{result['machine'].get('gpu', result['machine']['cpu'])}: prefill chunks of a "
                   f"{result['options']['tokens']}-token prompt (last round)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def one_run(options) -> dict:
    """One engine under `options.one`'s rule, one prompt after its warm-up."""
    pacing.WEIGHTS = RULES[options.one]  # read by each record()
    engine = engine_for(Path(options.model or EMBEDDED), "bfloat16" if DEVICE == "cuda" else "auto",
                        max_num_batched_tokens=2048, max_num_seqs=8)
    await engine.load_model()
    await engine.warmup()
    steps = recorded(engine)
    prompt = [random.Random(options.seed).randrange(3, engine.model.config.vocab_size) for _ in range(options.tokens)]
    result = await run_requests(engine, [prompt], 1)
    await unload(engine)
    return {"rule": options.one, "tokens": options.tokens, "ttft_s": round(result["wall_s"], 3),
            "target_s": engine.pacer.target_s, "weight": engine.pacer.weight,
            "steps": [s for s in steps if "seconds" in s]}


def run(options) -> dict:
    """Each rule's engine in a process of its own, the rules alternated: two engines in one process
    on a 2-core host slowed each other's steps (the prompt 106-122 s against 45-71 s alone)."""
    runs = []
    for round_ in range(options.rounds):
        for rule in (list(RULES) if round_ % 2 == 0 else list(RULES)[::-1]):
            line = subprocess.run([sys.executable, __file__, "--one", rule, "--seed", str(round_), "--tokens",
                                   str(options.tokens), *(["--model", options.model] if options.model else [])],
                                  check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs.append({"round": round_, **json.loads(line)})
            over = [s["seconds"] / runs[-1]["target_s"] for s in runs[-1]["steps"][:-1]]
            print(f"round {round_} {rule:8s}: {len(over) + 1} steps, {runs[-1]['ttft_s']:.2f} s, chunks "
                  f"{min(over):.2f}-{max(over):.2f}x the target, weight {runs[-1]['weight']:.2f}", flush=True)
    return {"benchmark": "prefill_pacing", "machine": machine(DEVICE), "when": time.strftime("%Y-%m-%d %H:%M"),
            "options": vars(options), "random_weights": drawn_at_random(Path(options.model or EMBEDDED)),
            "target_s": runs[0]["target_s"],
            "runs": runs, "summary": summary(runs, runs[0]["target_s"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a model folder (default the embedded model)")
    parser.add_argument("--tokens", type=int, default=7_800)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=RULES, help=argparse.SUPPRESS)  # a run of the parent's
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        print(json.dumps(asyncio.run(one_run(options))))
        return 0
    result = run(options)
    print(json.dumps(result["summary"], indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "prefill_pacing" + ("_cuda" if DEVICE == "cuda" else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
