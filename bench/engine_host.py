"""The native engine thread's host work of a decode step, without the forward pass, on CPU.

On a GPU a large batch's step can be set by the engine thread rather than the device (batch 256 of
the Llama-1B shape on an H100: the thread waited 0.03 ms of a 2.58 ms iteration; docs/benchmarks.md).
This times that thread's bookkeeping of the CUDA path's decode steps (launched ahead) on the
embedded model's tokenizer and block manager, a step's forward and sampling left out:
- `ahead`: Batcher.ahead, the next step's rows;
- `inputs`: HostInputs.fill, the CUDA graph's inputs on the host (unpinned here);
- `read`: _read, the step's tokens counted in the cache and appended;
- `emit`: _emit, text and messages (messages.py pacing, against a clock that moves --step-ms a step);
  the event loop's side of posting them is not counted.
Each with the text made in the engine (the engine in the worker's process) and left to the reader
(BaseEngine.leaves_text, the engine in its own), alternated, `--rounds` rounds, medians.
Writes bench/results/engine_host.json and .png; the JSON records the CPU's model and flags.

    python bench/engine_host.py [--batches 64,256] [--steps 300] [--rounds 3] [--step-ms 2.5]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.structured import machine  # noqa: E402
from worker.config_loader import load_config  # noqa: E402
from worker.engines.detokenizer import OutputText  # noqa: E402
from worker.engines.native import messages  # noqa: E402
from worker.engines.native.engine import NativeEngine  # noqa: E402
from worker.engines.native.graphs import HostInputs  # noqa: E402
from worker.engines.native.sequence import Sequence, Step  # noqa: E402
from worker.engines.sampler import make_generator  # noqa: E402
from worker.request import GenerationRequest, SamplingParams  # noqa: E402

RESULTS = REPO / "bench" / "results"
PARTS = ("ahead", "inputs", "read", "emit")
MODES = ("text in the engine", "text left to the reader")


class Clock:
    """messages.py's time, moved a step's time at each step."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load_engine(max_seqs: int) -> NativeEngine:
    config = load_config(None, {"HOME": str(Path.home())}, {
        "engine.name": "native", "engine.model": "smollm2-135m-instruct", "resources.memory_limit_gib": "10",
        "engine.args": json.dumps({"max_num_seqs": max_seqs, "speculation": "requested"})})
    engine = NativeEngine(config)
    engine._load()  # the model and the engine's state, no engine thread: the steps run here
    engine._post_all = lambda calls: None  # the event loop's side is not this thread's
    return engine


def sequences(engine: NativeEngine, batch: int, rng: random.Random) -> list[Sequence]:
    """`batch` running sequences, their 128-token prompts in the cache and one token sampled."""
    seqs = []
    for index in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(128)]
        request = GenerationRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                    sampling=SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        seq = Sequence(engine.make_stream(request.request_id), request, make_generator(request.sampling),
                       OutputText(engine.tokenizer, prompt, (), engine.eos_ids, render=not engine.leaves_text),
                       list(prompt), end=1 << 40, stop_ids=engine.eos_ids)
        engine.blocks.grow(seq.blocks, len(prompt) + 1)
        seq.num_cached = len(prompt)
        seq.append(rng.randrange(100, 40000))
        engine.batcher.running.append(seq)
        seqs.append(seq)
    return seqs


def run(engine: NativeEngine, batch: int, steps: int, step_s: float, clock: Clock) -> dict:
    """us a step by part, as the engine thread runs a decode step launched ahead: the next step's
    rows and inputs, the messages of the step before, the step's tokens read."""
    rng = random.Random(batch)
    seqs = sequences(engine, batch, rng)
    inputs = HostInputs(batch, 4096, pin=False)
    spent = dict.fromkeys(PARTS, 0.0)
    tokens = [torch.tensor([rng.randrange(100, 40000) for _ in seqs]) for _ in range(8)]
    step = Step([(seq, 1) for seq in seqs], ready=seqs, host_tokens=tokens[0])
    gc.collect()
    for index in range(steps):
        clock.now += step_s
        started = time.perf_counter()
        scheduled = engine.batcher.ahead(step.ready, batch, engine.decode_rows)
        ahead = time.perf_counter()
        inputs.fill(step.ready, engine.blocks.block_size, ahead=True)
        filled = time.perf_counter()
        engine._emit()
        emitted = time.perf_counter()
        engine._pending = engine._read(step)
        read = time.perf_counter()
        for part, (a, b) in zip(PARTS, ((started, ahead), (ahead, filled), (emitted, read), (filled, emitted))):
            spent[part] += b - a
        step = Step(scheduled, ready=step.ready, host_tokens=tokens[(index + 1) % len(tokens)])
    engine._emit()
    for seq in seqs:
        engine.batcher.drop(seq)
    return {part: seconds / steps * 1e6 for part, seconds in spent.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(batch, mode) for batch in result["batches"] for mode in MODES]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for part in PARTS:
        values = [result["us_per_step"][str(batch)][mode][part] for batch, mode in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), [f"batch {b}\n{m.replace('text ', '')}" for b, m in rows], fontsize=7)
    ax.set_ylabel("engine thread, us a decode step")
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['machine']['cpu']}: the native engine thread's host work a step, no forward", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=2.5, help="a step's time, for the messages' pacing")
    options = parser.parse_args()
    batches = [int(b) for b in options.batches.split(",")]
    clock = Clock()
    messages.time = SimpleNamespace(monotonic=clock)  # messages.py's pacing (only) sees a step take --step-ms
    engine = load_engine(max(batches))
    gc.collect()
    gc.freeze()  # as the worker does once loaded
    runs: dict[str, dict[str, list[dict]]] = {str(b): {mode: [] for mode in MODES} for b in batches}
    for round_ in range(options.rounds):
        for batch in batches:
            for mode in MODES:
                engine.leaves_text = mode == MODES[1]
                row = run(engine, batch, options.steps, options.step_ms / 1000, clock)
                runs[str(batch)][mode].append(row)
                print(f"round {round_} batch {batch:3d} {mode:24s}: {sum(row.values()):7.0f} us a step ("
                      + ", ".join(f"{k} {v:.0f}" for k, v in row.items()) + ")", flush=True)
    medians = {b: {mode: {part: statistics.median(r[part] for r in rows) for part in PARTS}
                   for mode, rows in by_mode.items()} for b, by_mode in runs.items()}
    for per_mode in medians.values():
        for parts in per_mode.values():
            parts["total"] = sum(parts[part] for part in PARTS)
    result = {"benchmark": "engine_host", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "batches": batches, "us_per_step": medians, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_host.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "engine_host.png")
    print(f"wrote {RESULTS / 'engine_host.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
