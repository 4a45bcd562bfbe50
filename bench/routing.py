"""Routing policies on a multi-turn chat workload, in one run: least-outstanding, prefix-affinity
and cache-aware behind one sidecar, on two setups:

- native: two native workers on the embedded model (one core each);
- synthetic: four synthetic workers that model a GPU's prefill (one prefill at a time, each
  uncached prompt token costing 1 / --prefill-rate s) and a prefix cache of --cache-blocks
  blocks each, least recently used evicted, publishing cache events like the native engine's.

Each setup also runs one worker alone with all the setups' cache memory and compute (twice or four
times the blocks, lanes and rate), the reference for the prefix-cache hit rate.

The workload: chats of --turns turns, each opening with one of three shared system prompts of
500-1,000 tokens; each turn sends the whole history (every earlier answer included), a user message
(10-40 words on the native setup, 40-120 on the synthetic one), and appends the answer. The chats
start --stagger s apart and wait --think s between turns; questions, prompts and start times come
from each of --seeds, so a run replays.

Per policy: prefix-cache hit rate (the workers' own counters), TTFT p50/p99 (first streamed
token), output tokens/s, requests per worker against the mean, and the sidecar's routing decisions
by reason. Writes bench/results/routing.json and routing.png. Needs `cargo build --release` of
sidecar/ and, for the native setup, the embedded model.

    python bench/routing.py [--setups native,synthetic] [--seeds 7,8,9]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.sidecar import free_port, sidecar_binary  # noqa: E402
from bench.structured import machine  # noqa: E402
from bench.transport import cy_llm, wait_ready  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
WORDS = ("archive ledger river mountain lantern harbor orchard meadow copper violet station garden bridge "
         "compass library engine winter summer planet signal quarter market window forest candle silver "
         "morning evening journal theory answer number letter island valley shadow thunder").split()
POLICIES = ("least-outstanding", "prefix-affinity", "cache-aware")


def system_prompts(rng: random.Random) -> list[str]:
    """Three system prompts of about 500, 750 and 1,000 tokens (the embedded tokenizer gives about
    one token a word here, the synthetic engine one a word)."""
    prompts = []
    for words in (490, 740, 990):
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        prompts.append(f"You are assistant number {len(prompts)}. Keep these notes in mind: {body}. Answer in one sentence.")
    return prompts


@dataclass(frozen=True)
class Setup:
    name: str
    workers: int
    chats: int
    turns: int
    max_tokens: int
    think_s: float
    stagger_s: float
    question_words: tuple[int, int]

    def worker_args(self, share: int, options) -> list[str]:
        """One worker's `cy-llm serve` arguments; `share` workers' worth of cache and compute."""
        if self.name == "native":
            return ["--engine", "native", "--set", f"engine.args.cpu_threads={share}",
                    "--set", f"engine.args.max_kv_blocks={options.native_kv_blocks * share}",
                    "--set", "resources.max_concurrency=8"]
        return ["--engine", "synthetic", "--set", f"engine.args.prefill_tokens_per_s={options.prefill_rate}",
                "--set", f"engine.args.prefill_lanes={share}", "--set", f"engine.args.tokens_per_s={2000 * share}",
                "--set", f"engine.args.prefix_cache_blocks={options.cache_blocks * share}",
                "--set", "engine.args.block_size=16", "--set", "resources.max_concurrency=64"]


@dataclass(frozen=True)
class Chat:
    start_s: float
    system: str
    questions: list[str]


def conversations(setup: Setup, seed: int) -> list[Chat]:
    rng = random.Random(seed)
    systems = system_prompts(rng)

    def question() -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*setup.question_words)))
        return f"Here are my notes: {words}. What links the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"

    return [Chat(i * setup.stagger_s * rng.uniform(0.5, 1.5), rng.choice(systems),
                 [question() for _ in range(setup.turns)]) for i in range(setup.chats)]


class Stack:
    def __init__(self, worker_args: list[list[str]], policy: str, sidecar_args: list[str]):
        self.dir = tempfile.mkdtemp(prefix="cyllm-routing-", dir="/tmp")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.sockets = [f"{self.dir}/w{i}.sock" for i in range(len(worker_args))]
        self.workers = [subprocess.Popen(cy_llm("serve", *args, "--socket", socket, "--set", "server.log_level=warning"),
                                         cwd=REPO, env=env) for socket, args in zip(self.sockets, worker_args)]
        for socket, proc in zip(self.sockets, self.workers):
            wait_ready(socket, proc)
        self.http, self.metrics = free_port(), free_port()
        self.sidecar = subprocess.Popen([
            str(sidecar_binary()), *(f"--worker=unix://{s}" for s in self.sockets), "--routing", policy,
            "--grpc-addr", f"127.0.0.1:{free_port()}", "--http-addr", f"127.0.0.1:{self.http}",
            "--metrics-addr", f"127.0.0.1:{self.metrics}", "--log", "warn", *sidecar_args])
        # Ready, and every worker's cache events followed (cache-aware routing needs them).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.counters().get("cyllm_sidecar_cache_events_live", 0) < len(self.sockets):
            time.sleep(0.1)  # another process's state: polled

    def counters(self) -> dict[str, float]:
        """Sums by metric name, and under name:label by worker (requests, prompt tokens, cache hits)
        or by reason (routing decisions)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics").text
        except httpx.HTTPError:
            return {}
        totals: dict[str, float] = {}
        split = {"cyllm_sidecar_requests_total": "worker", "cyllm_sidecar_routing_decisions_total": "reason",
                 "cyllm_prompt_tokens_total": "worker", "cyllm_prefix_cache_hits_tokens_total": "worker"}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name not in ("cyllm_prefix_cache_queries_tokens_total", "cyllm_sidecar_cache_events_live", *split):
                continue
            keys = [name]
            if name in split and f'{split[name]}="' in line:
                keys.append(name + ":" + line.split(f'{split[name]}="')[1].split('"')[0])
            for key in keys:
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def stop(self) -> None:
        for proc in (self.sidecar, *self.workers):
            proc.terminate()
            proc.wait(30)


def run_workload(http: int, chats: list[Chat], setup: Setup) -> dict:
    ttfts, tokens, lock = [], [0], threading.Lock()
    started = time.perf_counter()

    def chat(one: Chat) -> None:
        time.sleep(one.start_s)
        messages = [{"role": "system", "content": one.system}]
        with httpx.Client(timeout=300) as client:
            for question in one.questions:
                messages.append({"role": "user", "content": question})
                body = {"messages": messages, "max_tokens": setup.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                sent, first, answer = time.perf_counter(), None, ""
                with client.stream("POST", f"http://127.0.0.1:{http}/v1/chat/completions", json=body) as reply:
                    for line in reply.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = first or time.perf_counter()
                            answer += chunk["choices"][0]["delta"]["content"]
                        if chunk.get("usage"):
                            with lock:
                                tokens[0] += chunk["usage"]["completion_tokens"]
                with lock:
                    ttfts.append(((first or time.perf_counter()) - sent) * 1000)
                messages.append({"role": "assistant", "content": answer})
                time.sleep(setup.think_s)

    threads = [threading.Thread(target=chat, args=(c,)) for c in chats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"requests": len(ttfts), "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "output_tokens_per_s": tokens[0] / wall, "seconds": wall}


def measure(setup: Setup, workers: int, policy: str, chats: list[Chat], options) -> dict:
    share = setup.workers // workers
    stack = Stack([setup.worker_args(share, options) for _ in range(workers)], policy, options.sidecar_args.split())
    try:
        before = stack.counters()
        row = run_workload(stack.http, chats, setup)
        after = stack.counters()
    finally:
        stack.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queried = delta.get("cyllm_prefix_cache_queries_tokens_total", 0.0)
    row["hit_rate"] = delta.get("cyllm_prefix_cache_hits_tokens_total", 0.0) / queried if queried else 0.0
    per_worker = [delta.get(f"cyllm_sidecar_requests_total:w{i}", 0.0) for i in range(workers)]
    row["requests_per_worker"] = per_worker
    row["max_over_mean_load"] = max(per_worker) / (sum(per_worker) / len(per_worker)) if sum(per_worker) else 0.0
    # Prefill work: prompt tokens not found in the worker's cache.
    prefilled = [delta.get(f"cyllm_prompt_tokens_total:w{i}", 0.0) - delta.get(f"cyllm_prefix_cache_hits_tokens_total:w{i}", 0.0)
                 for i in range(workers)]
    row["prefill_tokens_per_worker"] = prefilled
    row["max_over_mean_prefill"] = max(prefilled) / (sum(prefilled) / len(prefilled)) if sum(prefilled) else 0.0
    row["decisions"] = {k.split(":", 1)[1]: v for k, v in delta.items()
                        if k.startswith("cyllm_sidecar_routing_decisions_total:") and v}
    row["policy"], row["workers"] = policy, workers
    print(f"{setup.name:9s} {workers} worker(s) {policy:18s} hit rate {row['hit_rate']:.3f}  "
          f"TTFT p50 {row['ttft_ms_p50']:7.0f} ms p99 {row['ttft_ms_p99']:7.0f} ms  "
          f"{row['output_tokens_per_s']:6.1f} tok/s  requests {per_worker} prefilled {[int(t) for t in prefilled]} "
          f"{row['decisions']}", flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    by_policy = {r["policy"]: r for r in rows if r["workers"] > 1}
    reference = next(r for r in rows if r["workers"] == 1)["hit_rate"]
    aware = by_policy["cache-aware"]
    return {"hit_rate_vs_one_worker": aware["hit_rate"] / reference if reference else None,
            "ttft_p50_vs_least_outstanding": aware["ttft_ms_p50"] / by_policy["least-outstanding"]["ttft_ms_p50"],
            "max_over_mean_load": aware["max_over_mean_load"], "max_over_mean_prefill": aware["max_over_mean_prefill"]}


def median_rows(runs: dict) -> list[dict]:
    """Per policy, the median over seeds of each figure the plot shows."""
    per_seed = [r["rows"] for r in runs.values()]
    return [{"policy": rows[0]["policy"], "workers": rows[0]["workers"],
             **{key: statistics.median(r[key] for r in rows)
                for key in ("hit_rate", "ttft_ms_p50", "ttft_ms_p99", "output_tokens_per_s", "max_over_mean_load")}}
            for rows in zip(*per_seed)]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = result["setups"]
    fig, axes = plt.subplots(len(setups), 2, figsize=(11, 4 * len(setups)), squeeze=False)
    for (hits, ttft), (name, one) in zip(axes, setups.items()):
        rows = one["rows"]
        labels = [r["policy"].replace("-", "-\n") if r["workers"] > 1 else "one worker\n(reference)" for r in rows]
        hits.bar(labels, [r["hit_rate"] for r in rows], color=["#888", "#a85", "#3a7", "#57a"][:len(rows)])
        hits.set_ylabel("prefix-cache hit rate (tokens)")
        hits.set_ylim(0, 1)
        hits.set_title(f"{name}: {one['setup']['workers']} workers, {one['setup']['chats']} chats x "
                       f"{one['setup']['turns']} turns, median of {len(one['seeds'])} seed(s)", fontsize=9)
        shown = [r for r in rows if r["workers"] > 1]
        for offset, q in ((-0.2, 50), (0.2, 99)):
            ttft.bar([i + offset for i in range(len(shown))], [r[f"ttft_ms_p{q}"] for r in shown], 0.38, label=f"p{q}")
        ttft.set_xticks(range(len(shown)), [r["policy"].replace("-", "-\n") for r in shown])
        ttft.set_ylabel("TTFT, ms")
        ttft.set_yscale("log")
        ttft.legend()
    fig.suptitle(result["machine"]["cpu"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SETUPS = {
    "native": Setup("native", workers=2, chats=8, turns=8, max_tokens=48, think_s=0.5, stagger_s=1.0,
                    question_words=(10, 40)),
    "synthetic": Setup("synthetic", workers=4, chats=96, turns=6, max_tokens=16, think_s=0.3, stagger_s=0.1,
                       question_words=(40, 120)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setups", default="native,synthetic", help="comma-separated: native, synthetic")
    parser.add_argument("--seeds", default="7", help="comma-separated; each seed is a workload of its own, and the "
                        "summary takes the median of the per-seed ratios")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; least-outstanding and "
                        "cache-aware are needed for the summary")
    parser.add_argument("--chats", type=int, help="the setup's number of chats instead of its own")
    parser.add_argument("--turns", type=int, help="the setup's turns per chat instead of its own")
    parser.add_argument("--prefill-rate", type=float, default=8000.0,
                        help="synthetic workers: uncached prompt tokens prefilled a second")
    parser.add_argument("--cache-blocks", type=int, default=256, help="synthetic workers: prefix cache blocks of 16 tokens")
    parser.add_argument("--native-kv-blocks", type=int, default=320, help="native workers: KV cache blocks of 16 tokens")
    parser.add_argument("--sidecar-args", default="", help="more sidecar flags, e.g. '--cache-balance-abs 4'")
    options = parser.parse_args()
    result: dict = {"benchmark": "routing", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
                    "options": vars(options), "setups": {}}
    for name in options.setups.split(","):
        setup = dataclasses.replace(SETUPS[name], chats=options.chats or SETUPS[name].chats,
                                    turns=options.turns or SETUPS[name].turns)
        runs = {}
        for seed in [int(s) for s in options.seeds.split(",")]:
            chats = conversations(setup, seed)
            rows = [measure(setup, setup.workers, policy, chats, options) for policy in options.policies.split(",")]
            rows.append(measure(setup, 1, "least-outstanding", chats, options))
            runs[seed] = {"rows": rows, "cache_aware": summary(rows)}
            print(name, seed, json.dumps(runs[seed]["cache_aware"]), flush=True)
        result["setups"][name] = {"setup": vars(setup), "seeds": runs, "rows": median_rows(runs),
                                  "cache_aware": {key: statistics.median(r["cache_aware"][key] for r in runs.values())
                                                  for key in next(iter(runs.values()))["cache_aware"]}}
        print(name, "median", json.dumps(result["setups"][name]["cache_aware"]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "routing.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "routing.png")
    print(f"wrote {RESULTS / 'routing.json'} and routing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
