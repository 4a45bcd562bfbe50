"""Routing policies on a multi-turn chat workload, in one run: least-outstanding, prefix-affinity
and cache-aware, two native workers on the embedded model (one core each) behind one sidecar, and
one worker alone as the reference for the prefix-cache hit rate (all the cache in one place).

The workload: --conversations chats of --turns turns, each opening with one of three shared
system prompts of 500-1,000 tokens; each turn sends the whole history (every earlier answer
included) and appends the model's answer. Questions and the choice of system prompt come from
--seed, so a run replays; the conversations run at once, each turn after the last.

Per policy: prefix-cache hit rate (the workers' own counters), TTFT p50/p99 (first streamed
token), output tokens/s, and requests per worker against the mean. Writes bench/results/routing.json
and routing.png. Needs `cargo build --release` of sidecar/ and the embedded model.

    python bench/routing.py [--conversations 8] [--turns 4] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
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
    one token a word here)."""
    prompts = []
    for words in (490, 740, 990):
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        prompts.append(f"You are assistant number {len(prompts)}. Keep these notes in mind: {body}. Answer in one sentence.")
    return prompts


def conversations(count: int, turns: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    systems = system_prompts(rng)
    return [(rng.choice(systems), [f"Question {t + 1}: what links the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
                                   for t in range(turns)]) for _ in range(count)]


class Stack:
    def __init__(self, workers: int, policy: str, threads: int):
        self.dir = tempfile.mkdtemp(prefix="cyllm-routing-", dir="/tmp")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.sockets = [f"{self.dir}/w{i}.sock" for i in range(workers)]
        self.workers = [subprocess.Popen(cy_llm(
            "serve", "--engine", "native", "--socket", socket, "--set", "server.log_level=warning",
            "--set", f"engine.args.cpu_threads={threads}", "--set", "resources.max_concurrency=8"), cwd=REPO, env=env)
            for socket in self.sockets]
        for socket, proc in zip(self.sockets, self.workers):
            wait_ready(socket, proc)
        self.http, self.metrics = free_port(), free_port()
        self.sidecar = subprocess.Popen([
            str(sidecar_binary()), *(f"--worker=unix://{s}" for s in self.sockets), "--routing", policy,
            "--grpc-addr", f"127.0.0.1:{free_port()}", "--http-addr", f"127.0.0.1:{self.http}",
            "--metrics-addr", f"127.0.0.1:{self.metrics}", "--log", "warn"])
        # Ready, and every worker's cache events followed (cache-aware routing needs them).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.followed(workers):
            time.sleep(0.1)  # another process's state: polled

    def followed(self, workers: int) -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics").text
        except httpx.HTTPError:
            return False
        live = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("cyllm_sidecar_cache_events_live{"))
        return live == workers

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics").text
        totals: dict[str, float] = {}
        for line in text.splitlines():
            for name in ("cyllm_prefix_cache_queries_tokens_total", "cyllm_prefix_cache_hits_tokens_total",
                         "cyllm_sidecar_requests_total"):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    key = name
                    if name == "cyllm_sidecar_requests_total":
                        key += ":" + line.split('worker="')[1].split('"')[0]
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def stop(self) -> None:
        for proc in (self.sidecar, *self.workers):
            proc.terminate()
            proc.wait(30)


def run_workload(http: int, chats: list[tuple[str, list[str]]]) -> dict:
    ttfts, tokens, lock = [], [0], threading.Lock()

    def chat(system: str, questions: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        with httpx.Client(timeout=300) as client:
            for question in questions:
                messages.append({"role": "user", "content": question})
                body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                started, first, answer = time.perf_counter(), None, ""
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
                    ttfts.append(((first or time.perf_counter()) - started) * 1000)
                messages.append({"role": "assistant", "content": answer})

    started = time.perf_counter()
    threads = [threading.Thread(target=chat, args=c) for c in chats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"requests": len(ttfts), "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "output_tokens_per_s": tokens[0] / wall, "seconds": wall}


def measure(workers: int, policy: str, threads: int, chats) -> dict:
    stack = Stack(workers, policy, threads)
    try:
        before = stack.counters()
        row = run_workload(stack.http, chats)
        after = stack.counters()
    finally:
        stack.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queried = delta.get("cyllm_prefix_cache_queries_tokens_total", 0.0)
    row["hit_rate"] = delta.get("cyllm_prefix_cache_hits_tokens_total", 0.0) / queried if queried else 0.0
    per_worker = [v for k, v in delta.items() if k.startswith("cyllm_sidecar_requests_total:") and not k.endswith(":none")]
    row["requests_per_worker"] = per_worker
    row["max_over_mean_load"] = max(per_worker) / (sum(per_worker) / len(per_worker)) if per_worker else 0.0
    row["policy"], row["workers"] = policy, workers
    print(f"{workers} worker(s) {policy:18s} hit rate {row['hit_rate']:.3f}  TTFT p50 {row['ttft_ms_p50']:7.0f} ms "
          f"p99 {row['ttft_ms_p99']:7.0f} ms  {row['output_tokens_per_s']:6.1f} tok/s  requests {per_worker}", flush=True)
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [r["policy"] if r["workers"] > 1 else "one worker\n(reference)" for r in rows]
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    hits.bar(labels, [r["hit_rate"] for r in rows], color=["#888", "#a85", "#3a7", "#57a"][:len(rows)])
    hits.set_ylabel("prefix-cache hit rate (tokens)")
    hits.set_ylim(0, 1)
    for offset, q in ((-0.2, 50), (0.2, 99)):
        ttft.bar([i + offset for i in range(len(rows))], [r[f"ttft_ms_p{q}"] for r in rows], 0.38, label=f"p{q}")
    ttft.set_xticks(range(len(rows)), labels)
    ttft.set_ylabel("TTFT, ms")
    ttft.legend()
    fig.suptitle(f"{result['workload']['conversations']} chats x {result['workload']['turns']} turns, "
                 f"2 native workers (1 core each); {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args()
    chats = conversations(options.conversations, options.turns, options.seed)
    result: dict = {"benchmark": "routing", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
                    "workload": vars(options), "rows": []}
    for policy in POLICIES:
        result["rows"].append(measure(2, policy, 1, chats))
    result["rows"].append(measure(1, "least-outstanding", 1, chats))
    rows = {r["policy"]: r for r in result["rows"] if r["workers"] == 2}
    reference = result["rows"][-1]["hit_rate"]
    result["cache_aware"] = {
        "hit_rate_vs_one_worker": rows["cache-aware"]["hit_rate"] / reference if reference else None,
        "ttft_p50_vs_least_outstanding": rows["cache-aware"]["ttft_ms_p50"] / rows["least-outstanding"]["ttft_ms_p50"],
        "max_over_mean_load": rows["cache-aware"]["max_over_mean_load"],
    }
    print(json.dumps(result["cache_aware"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "routing.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "routing.png")
    print(f"wrote {RESULTS / 'routing.json'} and routing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
