"""Speculative decoding (n-gram prompt lookup) on the native engine: decode tokens/s with speculation
on and off, in one run, alternated round by round (a shared machine's slow spell falls on both), at
batch 1 and 8, on three workloads:

- rag: questions through the RAG adapter over a small knowledge base (its passages in the prompt);
- rewrite: "fix the spelling and grammar of this paragraph" prompts (an edit: most of it is copied);
- chat: open-ended chat with nothing to quote.

The engine runs in this process with `speculation: requested`, and each request says on or off
(PredictRequest.speculative). 16 prompts a workload (sent `--passes` times a run: on a GPU a
batch-8 run of 16 takes ~0.2 s, where a hiccup moves the ratio by 10-30%), greedy, 128 new tokens
at most (streams end at EOS, the same in both modes: the bench checks the tokens are identical),
sent by `batch` clients that each send their next request when the last one ends. Batch 1 is judged
by its decode rate (tokens after each stream's first over the time after it: prefill left out);
batch 8 by completion tokens over the wall time, what a server at that concurrency serves (a
static batch of 8 waits for its longest stream, which speculation shortens only when that stream
repeats itself). Acceptance:
accepted / proposed tokens, from the engine's counters. partings: where streams that are not
identical first part, and the gap between the two most likely tokens there. lookup_bound: the
share of the output tokens (speculation off) that follow an n-gram (n = speculative_ngram_min) met
earlier in their prompt or output and followed there by the same token; n-gram proposals can have
no more accepted.

Writes bench/results/speculation_<device>[_<dtype> unless float32].json and .png (or --name's).

    python bench/speculation.py [--device cpu|cuda] [--batches 1,8] [--repeats 3] [--max-tokens 128]
                                [--passes 1] [--model NAME|FOLDER] [--dtype float32|bfloat16] [--args JSON]
                                [--workloads rag,rewrite,chat] [--random-weights] [--name NAME]
                                [--isa auto|avx512|avx2|default]

--isa: engine.cpu_isa, with oneDNN, ATen and MKL held to the same instruction set as the worker holds
them (cy-llm serve): an AVX-512 CPU measured as an AVX2 one would run the same code (not its caches
or clocks).

--random-weights: the text is noise and what repeats is whatever the random model loops on, so it
measures the mechanism's cost and gain on a device, not a workload's acceptance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from structured import drawn_at_random, machine, model_folder, random_weights  # noqa: E402

RESULTS = REPO / "bench" / "results"
KNOWLEDGE = {
    "amazon.md": "The Amazon rainforest covers much of the Amazon basin of South America. The basin encompasses "
                 "seven million square kilometres, of which five and a half million are covered by the rainforest. "
                 "The region includes territory belonging to nine nations and 3,344 indigenous territories.",
    "honey.md": "Honey bees make honey from the nectar of flowers. A worker bee carries nectar back to the hive in its "
                "honey stomach, where enzymes break its sugars down. Bees then spread the nectar in wax cells and fan "
                "it with their wings until most of the water evaporates, and seal each cell with a cap of wax.",
    "eiffel.md": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
                 "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889 as "
                 "the entrance arch to the 1889 World's Fair. It is 330 metres tall.",
    "moon.md": "The Moon is Earth's only natural satellite. It orbits at an average distance of 384,400 kilometres, "
               "about thirty times the diameter of Earth, and always shows the same face to Earth because its rotation "
               "is tidally locked to its orbit. Its gravity causes the tides of Earth's oceans.",
    "python.md": "Python is a high-level programming language created by Guido van Rossum and first released in 1991. "
                 "Its design emphasizes code readability with the use of significant indentation. Python is "
                 "dynamically typed and garbage-collected, and supports several programming paradigms.",
    "coffee.md": "Coffee is a beverage brewed from roasted coffee beans, the seeds of berries from Coffea plants. "
                 "The two most commonly grown species are arabica and robusta. Coffee plants grow in more than seventy "
                 "countries, mainly in the equatorial regions of the Americas, Southeast Asia and Africa.",
    "glacier.md": "A glacier is a persistent body of dense ice that moves under its own weight. Glaciers form where "
                  "the accumulation of snow exceeds its melting over many years. Glacial ice is the largest reservoir "
                  "of fresh water on Earth, holding about sixty-nine percent of the world's fresh water.",
    "volcano.md": "A volcano is a rupture in the crust of a planet that lets hot lava, volcanic ash and gases escape "
                  "from a magma chamber below the surface. On Earth, volcanoes are most often found where tectonic "
                  "plates are diverging or converging, and most are found underwater.",
}
QUESTIONS = ["How big is the Amazon basin?", "How do bees make honey?", "When was the Eiffel Tower built?",
             "How far away is the Moon?", "Who created Python?", "Where do coffee plants grow?",
             "How do glaciers form?", "Where are volcanoes found?", "Which nations share the Amazon rainforest?",
             "What do bees do with wax cells?", "How tall is the Eiffel Tower?", "Why does the Moon show one face?",
             "What is Python's design known for?", "What are the main kinds of coffee?",
             "How much fresh water do glaciers hold?", "What comes out of a volcano?"]
EDITS = ["Fix the spelling and grammar of this paragraph:", "Correct any mistakes in this paragraph and return it:"]
CHAT = ["Write a short poem about autumn.", "Give me three ideas for a birthday party.",
        "What should I pack for a weekend hike?", "Tell me a story about a dragon who loves music.",
        "Why do people enjoy travelling?", "Suggest a name for a bakery and explain it.",
        "What are good habits for learning a language?", "Describe your ideal city.",
        "How do I make a good cup of tea?", "Write a limerick about a cat.", "What makes a good friend?",
        "Plan a rainy Sunday for me.", "Explain why the sea is salty.", "Invent a new board game.",
        "What would you do with a time machine?", "Describe a walk through a forest at night."]
WORKLOADS = ("rag", "rewrite", "chat")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=1,
                        help="times each run sends the workload's prompts (a GPU's run of 16 takes ~0.2 s)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--args", default="{}", help="engine.args (JSON) beside speculation: requested")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--random-weights", action="store_true",
                        help="the model's config and tokenizer with new weights (a GPU host the weights cannot reach)")
    parser.add_argument("--name", help="the results' file name, without .json / .png (speculation_<device>[_<dtype>])")
    parser.add_argument("--isa", default="auto", help="engine.cpu_isa (CPU): the kernels' and libraries' instruction set")
    options = parser.parse_args()
    from worker.deps.hardware import isa_environment, this_cpu

    limits = isa_environment(options.isa, *this_cpu())
    os.environ.update(limits)  # read by oneDNN, ATen and MKL at their first op: none has run yet
    folder = model_folder(options.model)
    batches = [int(b) for b in options.batches.split(",")]
    with tempfile.TemporaryDirectory() as work:
        if options.random_weights:
            folder = random_weights(folder, Path(work), options.device)
        rows, settings = asyncio.run(measure(folder, options, batches))
        random = drawn_at_random(folder)
    result = {"benchmark": "speculation", "device": options.device, "machine": machine(options.device),
              "when": time.strftime("%Y-%m-%d %H:%M"), "model": options.model, "dtype": options.dtype,
              "cpu_isa": options.isa, "isa_limits": limits, "aten_capability": aten_capability(),
              "random_weights": random,
              "max_tokens": options.max_tokens, "passes": options.passes, "greedy": True, "settings": settings, "rows": rows,
              "targets": {"repeating_batch_1": 1.8, "non_repeating": 0.97}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / (options.name or f"speculation_{options.device}"
                      + ("" if options.dtype == "float32" else f"_{options.dtype}"))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    for row in rows:
        print(f"{row['workload']:8s} batch {row['batch']}: off {row['off_tokens_per_s']:.1f}, on {row['on_tokens_per_s']:.1f} "
              f"tok/s, speedup {row['speedup']:.2f} {row['speedups']}, acceptance {row['acceptance']:.2f}, "
              f"{row['tokens_per_verify']:.2f} tokens a verify, lookup bound {row['lookup_bound']:.2f}, "
              f"identical {row['identical']}"
              + (f" (partings: top-2 gaps up to {max(p['top_2_gap'] for p in row['partings']):.3f} nats)"
                 if row["partings"] else ""))
    return 0


def aten_capability() -> str:
    """The instruction set torch's own CPU kernels run (ATEN_CPU_CAPABILITY took effect or not)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


async def measure(folder: Path, options, batches: list[int]) -> tuple[list[dict], dict]:
    from bench.native_burst import unload
    from worker.adapters.knowledge_base import KnowledgeBase, build_index
    from worker.adapters.rag import RagAdapter
    from worker.config_loader import load_config
    from worker.engines.hosted import settle
    from worker.engines.native.engine import NativeEngine
    from worker.request import ChatMessage, GenerationRequest, SamplingParams

    config = load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(folder), "engine.device": options.device,
        "engine.dtype": options.dtype, "engine.cpu_isa": options.isa,
        "engine.args": json.dumps({"max_num_seqs": max(batches), **json.loads(options.args), "speculation": "requested"})})
    engine = NativeEngine(config)
    await engine.load_model()
    settle()
    work = tempfile.TemporaryDirectory()
    texts = Path(work.name) / "kb"
    texts.mkdir()
    for name, text in KNOWLEDGE.items():
        (texts / name).write_text(text + "\n")
    build_index(texts, Path(work.name) / "kb.sqlite")
    rag = RagAdapter("kb", KnowledgeBase(Path(work.name) / "kb.sqlite"), top_k=2, max_context_tokens=400)
    paragraphs = list(KNOWLEDGE.values())

    def prompts(workload: str) -> list[GenerationRequest]:
        if workload == "rag":
            made = [rag.prepare_prompt(GenerationRequest(
                request_id="", sampling=SamplingParams(), messages=(ChatMessage("user", q),)), engine.count_tokens)
                for q in QUESTIONS]
            return [m.messages for m in made]
        if workload == "rewrite":
            return [(ChatMessage("user", f"{edit}\n\n{p}"),) for edit in EDITS for p in paragraphs]
        return [(ChatMessage("user", q),) for q in CHAT]

    async def one(req: GenerationRequest) -> tuple[list[int], float, float]:
        tokens, first = [], None
        async for out in engine.stream_predict(req):
            if first is None and out.token_ids:
                first = time.perf_counter()
            tokens.extend(out.token_ids)
        return tokens, first, time.perf_counter()

    async def run(workload: str, batch: int, on: bool) -> dict:
        """Every prompt of the workload, `batch` at a time: each client sends its next request as
        soon as its last one ends (as a server at that concurrency sees them)."""
        waiting = []
        for index, messages in enumerate(prompts(workload) * options.passes):
            req = GenerationRequest(request_id=f"{workload}-{index}", messages=messages, speculative=on,
                                    sampling=SamplingParams(max_tokens=options.max_tokens))
            req.prompt_token_ids = engine.encode(req)
            engine.prepare(req)
            waiting.append(req)
        prompt_ids = [req.prompt_token_ids for req in waiting]
        replies = [None] * len(waiting)

        async def client() -> None:
            while waiting:
                index = len(replies) - len(waiting)
                replies[index] = await one(waiting.pop(0))

        before = engine.speculation_stats()
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(batch)))
        wall = time.perf_counter() - started
        after = engine.speculation_stats()
        tokens = sum(len(t) for t, _, _ in replies)
        decoded = sum(len(t) - 1 for t, _, _ in replies)
        return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
                "decode_tokens_per_s": decoded / sum(end - first for _, first, end in replies),
                "lengths": [len(t) for t, _, _ in replies], "outputs": [t for t, _, _ in replies], "prompts": prompt_ids,
                "verifies": after[0] - before[0], "proposed": after[1] - before[1], "accepted": after[2] - before[2]}

    async def partings(off_runs: list[dict], on_runs: list[dict]) -> list[dict]:
        """Where greedy streams with speculation on first part from their twins with it off: the
        token's index and the gap between the two most likely tokens there, in nats, from a request
        of one token (top-2 logprobs) whose prompt is the stream so far: a prompt's last row, not a
        decode step's, so a gap of 0 is a tie at that row's rounding (why near ties part:
        docs/native.md)."""
        found = {}
        for off, on in zip(off_runs, on_runs):
            for stream, (prompt, a, b) in enumerate(zip(off["prompts"], off["outputs"], on["outputs"])):
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                if a == b or (stream, at) in found:
                    continue
                req = GenerationRequest(request_id=f"parting-{stream}-{at}", prompt_token_ids=prompt + a[:at],
                                        speculative=False, logprobs=2, sampling=SamplingParams(max_tokens=1))
                engine.prepare(req)
                top = [o.logprobs[0].top async for o in engine.stream_predict(req) if o.logprobs][0]
                found[stream, at] = {"stream": stream, "token": at, "top_2_gap": round(top[0][1] - top[1][1], 4)}
        return list(found.values())

    try:
        for on in (False, True):  # warm both paths
            await run("rewrite", max(batches), on)  # (16 requests)
        rows = []
        for workload in options.workloads.split(","):
            for batch in batches:
                runs = {False: [], True: []}
                for round_ in range(options.repeats):
                    for on in ((False, True) if round_ % 2 == 0 else (True, False)):
                        runs[on].append(await run(workload, batch, on))
                # Batch 1: the stream's decode rate; batch 8: completion tokens over the wall time.
                metric = "decode_tokens_per_s" if batch == 1 else "tokens_per_s"
                speedups = [on[metric] / off[metric] for off, on in zip(runs[False], runs[True])]
                proposed = sum(r["proposed"] for r in runs[True])
                accepted = sum(r["accepted"] for r in runs[True])
                verifies = sum(r["verifies"] for r in runs[True])
                rows.append({
                    "workload": workload, "batch": batch, "metric": metric,
                    "off_tokens_per_s": statistics.median(r[metric] for r in runs[False]),
                    "on_tokens_per_s": statistics.median(r[metric] for r in runs[True]),
                    "speedup": statistics.median(speedups), "speedups": [round(s, 3) for s in speedups],
                    "throughput_speedup": statistics.median(
                        on["tokens_per_s"] / off["tokens_per_s"] for off, on in zip(runs[False], runs[True])),
                    "acceptance": accepted / proposed if proposed else 0.0,
                    "tokens_per_verify": (accepted + verifies) / verifies if verifies else 0.0,
                    "proposed": proposed, "accepted": accepted, "verifies": verifies,
                    "identical": all(a["outputs"] == b["outputs"] for a, b in zip(runs[False], runs[True])),
                    "partings": await partings(runs[False], runs[True]),
                    "lookup_bound": lookup_bound(runs[False][0]["prompts"], runs[False][0]["outputs"],
                                                 engine.speculator.settings.ngram_min),
                    "lengths": runs[False][0]["lengths"]})
                print(f"{workload} batch {batch}: speedups {[round(s, 3) for s in speedups]}", flush=True)
        s = engine.speculator.settings
        return rows, {"speculative_tokens": s.num_tokens, "ngram": [s.ngram_min, s.ngram_max],
                      "min_accepted": s.min_accepted}
    finally:
        rag.close()
        work.cleanup()
        await unload(engine)


def lookup_bound(prompts: list[list[int]], outputs: list[list[int]], n: int) -> float:
    """The share of output tokens that follow an n-gram seen earlier in their prompt or output,
    followed there by the same token: at most what n-gram lookup can propose and see accepted."""
    hits = total = 0
    for prompt, output in zip(prompts, outputs):
        tokens, seen = prompt + output, {}
        for j in range(n, len(tokens)):
            context = tuple(tokens[j - n:j])
            if j >= len(prompt):
                total += 1
                hits += tokens[j] in seen.get(context, ())
            seen.setdefault(context, set()).add(tokens[j])
    return hits / total if total else 0.0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["off_tokens_per_s"] for r in rows], 0.4, label="speculation off")
    ax.bar([i + 0.2 for i in x], [r["on_tokens_per_s"] for r in rows], 0.4, label="speculation on")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["on_tokens_per_s"], f"{r['speedup']:.2f}x\n{r['acceptance']:.0%}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{r['workload']}\nbatch {r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.margins(y=0.15)  # room above the tallest bar for its label
    limited = f", held to {result['aten_capability']}" if result.get("isa_limits") else ""
    ax.set_title(f"native, {result['device']} ({result['dtype']}): "
                 f"{result['machine'].get('gpu', result['machine']['cpu'])}{limited}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
