"""The native engine's host work of a decode step, without the forward pass, on CPU.

On a GPU a large batch's step can be set by the engine thread rather than the device (batch 256 of
the Llama-1B shape on an H100: the thread waited 0.03 ms of a 2.58 ms iteration; docs/benchmarks.md).
This times that thread's bookkeeping of the CUDA path's decode steps (launched ahead) on the
embedded model's tokenizer and block manager, a step's forward and sampling left out:
- `ahead`: Batcher.ahead, the next step's rows;
- `inputs`: HostInputs.fill, the CUDA graph's inputs on the host (unpinned here);
- `read`: _read, the step's tokens counted in the cache and appended;
- `emit`: _emit, text and messages (messages.py pacing, against a clock that moves --step-ms a step);
and what the step's outputs cost the event loop beside it (`loop`, the same interpreter lock):
- with the text made in the engine (the engine in the worker's process): the outputs put into
  the requests' streams;
- with the text left to the reader (BaseEngine.leaves_text, the engine in its own process,
  hosted.py): the outputs put into the forwarding streams and pickled into the step's message;
  then, in the worker's process (`worker`, another interpreter), that message read into the
  requests' streams and their text rendered (process.py). The streams' consumers are not counted.
Both, alternated, `--rounds` rounds, medians.
Writes bench/results/engine_host.json and .png; the JSON records the CPU's model and flags.

    python bench/engine_host.py [--batches 64,256] [--steps 300] [--rounds 3] [--step-ms 2.5]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
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
from worker.engines import hosted, threaded  # noqa: E402
from worker.engines.base import RequestStream  # noqa: E402
from worker.engines.detokenizer import OutputText  # noqa: E402
from worker.engines.native import messages  # noqa: E402
from worker.engines.native.engine import NativeEngine  # noqa: E402
from worker.engines.native.graphs import HostInputs  # noqa: E402
from worker.engines.native.sequence import Sequence, Step  # noqa: E402
from worker.engines.process import ProcessEngine  # noqa: E402
from worker.engines.sampler import make_generator  # noqa: E402
from worker.request import GenerationRequest, SamplingParams  # noqa: E402

RESULTS = REPO / "bench" / "results"
PARTS = ("ahead", "inputs", "read", "emit", "loop", "worker")
ENGINE_THREAD = PARTS[:4]
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
    return engine


class Written:
    """A Channel's writer that keeps what is written, for the worker's side to read back."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def messages(self) -> list:
        """What was written since the last call, unpickled, as Channel.receive reads it."""
        found, at = [], 0
        while at < len(self.data):
            size, = hosted.HEADER.unpack_from(self.data, at)
            found.append(pickle.loads(self.data[at + hosted.HEADER.size:at + hosted.HEADER.size + size]))
            at += hosted.HEADER.size + size
        del self.data[:]
        return found


def own_process(engine: NativeEngine) -> tuple[hosted.Host, ProcessEngine, Written]:
    """The two ends of an engine in its own process, without the process: the engine's Host (its
    loop's side: forwarding streams, the step's message) and the worker's ProcessEngine."""
    host = hosted.Host.__new__(hosted.Host)  # not its constructor: that makes an engine of its own
    host.engine, host.events, host.streams, host._adding = engine, [], {}, -1
    written = Written()
    host.channel = hosted.Channel(None, written)
    host._loop = SimpleNamespace(call_soon=lambda callback: None)  # _flush is called once a step, in run
    worker = ProcessEngine.__new__(ProcessEngine)
    worker._streams, worker._keys, worker._texts, worker.events = {}, {}, {}, engine.events
    return host, worker, written


def sequences(engine: NativeEngine, batch: int, rng: random.Random,
              ends: tuple[hosted.Host, ProcessEngine, Written] | None) -> list[Sequence]:
    """`batch` running sequences, their 128-token prompts in the cache and one token sampled; with
    `ends`, each forwarded to a stream of the worker's side, as hosted.py and process.py do."""
    seqs = []
    for index in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(128)]
        request = GenerationRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                    sampling=SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        if ends is not None:
            host, worker, _ = ends
            host._adding = index
            worker._streams[index] = RequestStream(request.request_id)
            worker._texts[index] = OutputText(engine.tokenizer, prompt, (), engine.eos_ids), request.sampling
        seq = Sequence(host._stream(request.request_id) if ends is not None else RequestStream(request.request_id),
                       request, make_generator(request.sampling),
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
    ends = own_process(engine) if engine.leaves_text else None
    seqs = sequences(engine, batch, rng, ends)
    calls: list = []
    engine._post_all = calls.extend  # the event loop's side, run below
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
        threaded._run_all(calls)
        if ends is not None:
            ends[0]._flush()
        looped = time.perf_counter()
        for message in ends[2].messages() if ends is not None else ():
            ends[1]._on_message(message)
        received = time.perf_counter()
        calls.clear()
        for part, (a, b) in zip(PARTS, ((started, ahead), (ahead, filled), (emitted, read), (filled, emitted),
                                        (read, looped), (looped, received))):
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
    for part in (*ENGINE_THREAD, "loop"):  # the engine's process, one interpreter lock
        values = [result["us_per_step"][str(batch)][mode][part] for batch, mode in rows]
        ax.bar([i - 0.15 for i in range(len(rows))], values, 0.3, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([i + 0.15 for i in range(len(rows))], [result["us_per_step"][str(b)][m]["worker"] for b, m in rows], 0.3,
           color="0.6", label="worker (the worker's process)")
    ax.set_xticks(range(len(rows)), [f"batch {b}\n{m.replace('text ', '')}" for b, m in rows], fontsize=7)
    ax.set_ylabel("host, us a decode step")
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['machine']['cpu']}: the native engine's host work a step, no forward", fontsize=9)
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
    hosted.settle()  # as the worker does once loaded
    runs: dict[str, dict[str, list[dict]]] = {str(b): {mode: [] for mode in MODES} for b in batches}
    for round_ in range(options.rounds):
        for batch in batches:
            for mode in MODES:
                engine.leaves_text = mode == MODES[1]
                row = run(engine, batch, options.steps, options.step_ms / 1000, clock)
                runs[str(batch)][mode].append(row)
                print(f"round {round_} batch {batch:3d} {mode:24s}: engine thread "
                      f"{sum(row[part] for part in ENGINE_THREAD):5.0f} us a step, its process "
                      f"{sum(row[part] for part in ENGINE_THREAD) + row['loop']:5.0f} ("
                      + ", ".join(f"{k} {v:.0f}" for k, v in row.items()) + ")", flush=True)
    medians = {b: {mode: {part: statistics.median(r[part] for r in rows) for part in PARTS}
                   for mode, rows in by_mode.items()} for b, by_mode in runs.items()}
    for per_mode in medians.values():
        for parts in per_mode.values():
            parts["engine_thread"] = sum(parts[part] for part in ENGINE_THREAD)
            parts["engine_process"] = parts["engine_thread"] + parts["loop"]  # one interpreter lock
    result = {"benchmark": "engine_host", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
              "options": vars(options), "batches": batches, "us_per_step": medians, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_host.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "engine_host.png")
    print(f"wrote {RESULTS / 'engine_host.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
