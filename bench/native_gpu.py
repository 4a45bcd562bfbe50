"""The native engine on a GPU next to HF transformers, in one run.

For each model shape (random weights, default RoPE; a word-level tokenizer of the shape's vocabulary):
1. equivalence (first shape, fp32): greedy ids of the native engine (CUDA graphs, Triton decode)
   against HF's forward for prompts one by one and batched with a shared prefix; one step's logits;
2. throughput, bf16, 128 prompt / 256 new tokens at each batch: the native engine as the worker
   makes it (on CUDA in its own process; all requests submitted at once) and HF `generate` (eager,
   static batch); time from start to ready;
3. a step-time model (bench/gpu_roofline.py) at every batch: the decode step's lower bound from its
   weight + KV bytes and its FLOPs against the measured copy bandwidth and bf16 matmul rate, each run
   as a fraction of it (and of that bound from both ceilings as the board holds them under its
   power limit, bench/gpu_power.py; the SM clock, power and the reasons for a lowered clock are
   sampled through each run), and the batch's prefill (timed alone, the engine in this process) as
   a fraction of the matmul rate; the decode steps under the torch profiler (device time by kernel,
   the host's gaps) and the step's device floor (its graph back to back, no host between), the
   engine in this process; the decode-attention kernel alone, split and not, by context length
   (bench/attention_split.py), and the decode step at long contexts (1-16 sequences of 4k-32k tokens:
   the device floor against the step's bound);
4. prefix sharing (first shape): 64 requests after one 1,024-token system prompt, cache on and off.

Writes bench/results/native_gpu.json and .png (--name: another name, e.g. native_gpu_h200).

    python bench/native_gpu.py [--shapes llama-3.2-1b,llama-3.1-8b] [--batches 1,16,64,256] [--repeats 3]
                               [--skip-equivalence] [--skip-prefix] [--name native_gpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.attention_split import decode_attention_split, long_context_steps  # noqa: E402
from bench.gpu_power import GpuSampler, clock, held_rates  # noqa: E402
from bench.gpu_roofline import (DecodeProfile, StepModel, copy_bandwidth, device_floor, floor_gaps,  # noqa: E402
                                matmul_peak, synchronize)
from bench.native_burst import DEVICE, SHAPES, engine_for, make_folder, run_requests, unload  # noqa: E402
from bench.structured import machine  # noqa: E402
from worker.engines.factory import runs_in_own_process  # noqa: E402
from worker.engines.hosted import settle  # noqa: E402

RESULTS = REPO / "bench" / "results"
PROMPT, NEW = 128, 256


@torch.inference_mode()
def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    out = model(torch.tensor([ids], device=DEVICE), use_cache=True)
    tokens = []
    for _ in range(count):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]], device=DEVICE), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_generate(model, batch: int, new_tokens: int) -> float:
    ids = torch.randint(2, model.config.vocab_size, (batch, PROMPT), device=DEVICE)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    synchronize(DEVICE)
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    synchronize(DEVICE)
    return batch * (out.shape[1] - PROMPT) / (time.perf_counter() - started)


async def equivalence(shape: dict, work: Path) -> dict:
    folder = work / "fp32"
    hf = make_folder(shape, torch.float32, folder)
    rng = random.Random(1)
    shared = [rng.randrange(2, shape["vocab_size"]) for _ in range(40)]
    prompts = [shared + [rng.randrange(2, shape["vocab_size"]) for _ in range(n)] for n in (3, 17, 30, 9)]
    prompts.append([rng.randrange(2, shape["vocab_size"]) for _ in range(21)])
    expected = [hf_greedy(hf, ids, 32) for ids in prompts]
    engine = engine_for(folder, "float32", max_num_seqs=8)
    await engine.load_model()
    try:
        one_by_one = [(await run_requests(engine, [ids], 32))["outputs"][0] for ids in prompts]
        together = (await run_requests(engine, prompts, 32))["outputs"]
        from worker.engines.native.batch import Batch

        ids = prompts[0]
        blocks = list(range(-(-len(ids) // 16)))
        batch = Batch(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE),
                      torch.arange(len(ids), device=DEVICE), [len(ids)], [len(ids)], [blocks],
                      torch.tensor([len(ids) - 1], device=DEVICE), 16)
        with torch.inference_mode():
            reference = hf(torch.tensor([ids], device=DEVICE)).logits[0, -1].float()
            logits = engine.model(batch, engine.k_cache, engine.v_cache)[0]
        max_diff = float((logits - reference).abs().max())
    finally:
        await engine.unload_model()
    del hf
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    matches = [a == b for a, b in zip(one_by_one, expected)] + [a == b for a, b in zip(together, expected)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(together, expected)]
    return {"prompts": len(prompts), "new_tokens": 32, "dtype": "float32",
            "identical_one_by_one": sum(matches[:len(prompts)]), "identical_batched": sum(matches[len(prompts):]),
            "first_differing_token_batched": first_diff, "logits_max_abs_diff": max_diff,
            "logits_scale": float(reference.abs().max())}


async def prefix_sharing(folder: Path, vocab: int) -> dict:
    rng = random.Random(2)
    system = [rng.randrange(2, vocab) for _ in range(1024)]
    prompts = [system + [rng.randrange(2, vocab) for _ in range(32)] for _ in range(64)]
    rows = {}
    for caching in (False, True):
        engine = engine_for(folder, "bfloat16", enable_prefix_caching=caching)
        await engine.load_model()
        settle()
        try:
            await run_requests(engine, [system + [5, 6, 7]], 4)  # the system prompt seen once before
            result = await run_requests(engine, prompts, 64)
            result.pop("outputs")
            result["prefix_hit_tokens"] = engine.batcher.prefix_hit_tokens
            rows["on" if caching else "off"] = result
        finally:
            await unload(engine)
        print(f"  prefix cache {'on ' if caching else 'off'}: {result['tokens_per_s']:8.0f} tok/s, TTFT p50 "
              f"{result['ttft_ms_p50']:.0f} ms, p99 {result['ttft_ms_p99']:.0f} ms", flush=True)
    return rows


async def throughput(name: str, shape: dict, batches: list[int], work: Path, bandwidth: float, peak: float,
                     prefix: bool, repeats: int, held: dict | None = None) -> dict:
    """`held`: gpu_power.held_rates, the ceilings as the board holds them (CUDA)."""
    folder = work / name
    hf = make_folder(shape, torch.bfloat16, folder)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    model = StepModel(shape, bandwidth, peak)
    held_model = StepModel(shape, held["copy_bytes_per_s"], held["matmul_flops"]) if held else None
    row = {"shape": name, **shape, "weight_bytes": weight_bytes,
           "roofline_batch1_tokens_per_s": 1000 / model.decode(1, PROMPT + NEW / 2)["bound_ms"],
           "hf_generate": {}, "native": {}, "profile": {}}
    for batch in batches:
        row["hf_generate"][batch] = hf_generate(hf, batch, NEW)
        print(f"  {name} HF generate batch {batch}: {row['hf_generate'][batch]:8.0f} tok/s", flush=True)
    del hf
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    started = time.perf_counter()
    engine = engine_for(folder, "bfloat16", as_worker=True)
    row["engine_in_own_process"] = runs_in_own_process(engine.config)
    await engine.load_model()
    await engine.warmup()  # as the worker does before it says ready: Triton's kernels compile here
    row["native_ready_s"] = time.perf_counter() - started
    settle()
    rng = random.Random(3)
    try:
        await run_requests(engine, [[rng.randrange(2, shape["vocab_size"]) for _ in range(PROMPT)]] * 2, 8)
        for batch in batches:
            # A warm-up at this batch size, as HF gets one: the allocator and cuBLAS settle on its
            # shapes (the first batch-256 run was ~30% slower). Other prompts, so no prefix hits.
            warm = [[rng.randrange(2, shape["vocab_size"]) for _ in range(PROMPT)] for _ in range(batch)]
            await run_requests(engine, warm, 16)
            # Then `repeats` runs, each figure the median of its runs': a shared host's noise moves a
            # single run of the small batches by 15% (the engine thread must keep ahead of the
            # device), and a run's tokens/s mixes its burst's prefill with its decode steps (one of
            # three batch-64 runs once made 28.8k tok/s against 42-45k).
            runs, gpus = [], []
            for _ in range(repeats):
                prompts = [[rng.randrange(2, shape["vocab_size"]) for _ in range(PROMPT)] for _ in range(batch)]
                with GpuSampler() as gpu:
                    runs.append(await run_requests(engine, prompts, NEW))
                gpus.append(gpu.summary())
                runs[-1].pop("outputs")
            each = ", ".join(f"{r['tokens_per_s']:.0f} ({r['decode_step_ms']:.3f} ms{clock(g)})"
                             for r, g in zip(runs, gpus))
            result = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            result["runs"] = [{**{key: r[key] for key in ("tokens_per_s", "decode_step_ms", "ttft_ms_max")}, "gpu": g}
                              for r, g in zip(runs, gpus)]
            # The step model at the decode's mean context.
            decode = model.decode(batch, PROMPT + NEW / 2)
            result["decode_bound"] = {**decode, "of_bound": decode["bound_ms"] / result["decode_step_ms"],
                                      "of_serial": decode["serial_ms"] / result["decode_step_ms"]}
            if held_model is not None:  # the same bound from the ceilings the board holds
                decode_held = held_model.decode(batch, PROMPT + NEW / 2)
                result["held_bound"] = {**decode_held, "of_bound": decode_held["bound_ms"] / result["decode_step_ms"]}
            row["native"][batch] = result
            print(f"  {name} native batch {batch}: {result['tokens_per_s']:8.0f} tok/s (HF "
                  f"{row['hf_generate'][batch]:.0f}), TTFT p50 {result['ttft_ms_p50']:.0f} ms; runs "
                  f"{each}; decode step {result['decode_step_ms']:.3f} ms = "
                  f"{result['decode_bound']['of_bound']:.0%} of its {decode['bound_by']} bound "
                  f"{decode['bound_ms']:.3f} ms, {result['decode_bound']['of_serial']:.0%} of its serial bound "
                  f"{decode['serial_ms']:.3f} ms" + (f"; {result['held_bound']['of_bound']:.0%} of the bound as "
                  f"the board holds its ceilings, {result['held_bound']['bound_ms']:.3f} ms" if held_model else ""),
                  flush=True)
    finally:
        await unload(engine)
    await in_process(name, folder, shape["vocab_size"], row, model)
    if DEVICE == "cuda":
        row["long_context"] = await long_context_steps(folder, shape, model)
    if prefix:
        row["prefix_sharing"] = await prefix_sharing(folder, shape["vocab_size"])
    return row


async def in_process(name: str, folder: Path, vocab: int, row: dict, model: StepModel) -> None:
    """What needs the engine in this process, at each batch of row["native"]: the prefill of the
    whole batch timed alone (one token each, median of 3: in the decode runs the last prompts'
    chunks share steps with the first ones' decodes, and through a process of its own a burst's
    first tokens came later, docs/benchmarks.md); on CUDA the decode steps under the torch profiler
    (device time by kernel, the host's gaps; it sees no other process's kernels) and the device floor."""
    engine = engine_for(folder, "bfloat16")
    await engine.load_model()
    await engine.warmup()
    settle()
    rng = random.Random(4)
    try:
        for batch, result in row["native"].items():
            def prompts() -> list[list[int]]:
                return [[rng.randrange(2, vocab) for _ in range(PROMPT)] for _ in range(batch)]

            await run_requests(engine, prompts(), 16)
            alone = sorted([(await run_requests(engine, prompts(), 1))["ttft_ms_max"] for _ in range(3)])[1]
            prefill = model.prefill(batch, PROMPT)
            result["prefill_bound"] = {**prefill, "prefill_alone_ms": alone, "of_peak": prefill["bound_ms"] / alone,
                                       "of_peak_with_decodes": prefill["bound_ms"] / result["ttft_ms_max"]}
            print(f"  {name} prefill of {prefill['tokens']} tokens alone {alone:.1f} ms = "
                  f"{result['prefill_bound']['of_peak']:.0%} of the matmul peak (beside decodes "
                  f"{result['ttft_ms_max']:.1f} ms)", flush=True)
            if DEVICE != "cuda":
                continue
            steps = row["profile"][batch] = (await run_requests(engine, prompts(), 64, DecodeProfile()))["decode_profile"]
            print(f"  {name} decode profile batch {batch}: {steps['wall_ms_per_step']:.3f} ms a step, device busy "
                  f"{steps['device_busy_ms_per_step']:.3f}, {steps['kernels_per_step']:.0f} kernels: " + "; ".join(
                      f"{k['kernel'][:32]} {k['ms_per_step']:.3f}" for k in steps["top"][:6]), flush=True)
        for batch, result in row["native"].items() if DEVICE == "cuda" else ():  # last: it writes the cache
            with GpuSampler() as gpu:
                floor = device_floor(engine, batch, PROMPT + NEW // 2, steps=200)  # long enough to be sampled
            gaps = floor_gaps(engine, batch, PROMPT + NEW // 2)
            result["device_floor"] = {"ms": floor, "of_bound": result["decode_bound"]["bound_ms"] / floor, "gaps": gaps,
                                      "gpu": gpu.summary()}
            print(f"  {name} batch {batch}: the device alone {floor:.3f} ms a step{clock(gpu.summary())} = "
                  f"{result['device_floor']['of_bound']:.0%}"
                  f" of the bound; the engine's step {result['decode_step_ms']:.3f}; under the profiler kernels "
                  f"{gaps['kernels_ms']:.3f} ms, idle {gaps['idle_ms']:.3f} (before cuBLAS's GEMMs "
                  f"{gaps['idle_before_library_gemms_ms']:.3f}, theirs {gaps['library_gemms_ms']:.3f})", flush=True)
    finally:
        await unload(engine)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["shapes"]
    long = any("long_context" in row for row in rows)
    fig, axes = plt.subplots(1 + long, len(rows), figsize=(6 * len(rows), 4.5 * (1 + long)), squeeze=False)
    for ax, row in zip(axes[0], rows):
        batches = list(row["native"])
        x = range(len(batches))
        ax.bar([i - 0.2 for i in x], [row["hf_generate"][b] for b in batches], 0.4, label="HF generate (eager)")
        ax.bar([i + 0.2 for i in x], [row["native"][b]["tokens_per_s"] for b in batches], 0.4, label="native")
        bounds = [int(b) * 1000 / row["native"][b]["decode_bound"]["bound_ms"] for b in batches]
        ax.plot([i + 0.2 for i in x], bounds, "k_", markersize=30, label="decode step-model bound")
        if floors := [(i + 0.2, int(b) * 1000 / row["native"][b]["device_floor"]["ms"]) for i, b in enumerate(batches)
                      if "device_floor" in row["native"][b]]:
            ax.plot(*zip(*floors), "kx", label="the device alone (no host between steps)")
        for i, b in enumerate(batches):
            ax.annotate(f"{row['native'][b]['decode_bound']['of_bound']:.0%}", (i + 0.2, row["native"][b]["tokens_per_s"]),
                        ha="center", va="top", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(top=max(bounds) * 30)  # room for the legend
        ax.set_xticks(list(x), [f"batch {b}" for b in batches])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{row['shape']} shape, bf16, {PROMPT} prompt / {NEW} new")
        ax.legend()
    for ax, row in zip(axes[1] if long else (), rows):
        cases = row.get("long_context", [])
        x = range(len(cases))
        ax.bar([i - 0.2 for i in x], [c["bound_ms"] for c in cases], 0.4, color="0.7", label="step-model bound")
        ax.bar([i + 0.2 for i in x], [c["step_ms"] for c in cases], 0.4, label="native, the device alone")
        for i, c in enumerate(cases):
            ax.annotate(f"{c['of_bound']:.0%}", (i + 0.2, c["step_ms"]), ha="center", va="bottom", fontsize=8)
        labels = [f"{c['batch']} x {c['context'] // 1024}k" if "long_rows" not in c else  # few long among short
                  f"{c['long_rows']} x {c['context'] // 1024}k\n+{c['batch'] - c['long_rows']}\nx {c['short_context']}"
                  for c in cases]
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("ms a decode step")
        ax.set_title(f"{row['shape']}: decode at long contexts")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--skip-equivalence", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true", help="leave out the prefix-sharing run")
    parser.add_argument("--repeats", type=int, default=3, help="native runs at each batch size; the median is reported")
    parser.add_argument("--name", default="native_gpu", help="the results' file name, without .json / .png")
    args = parser.parse_args()
    names = args.shapes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    result = {"benchmark": "native_gpu", "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(DEVICE), "prompt_tokens": PROMPT, "new_tokens": NEW}
    result["copy_bandwidth_bytes_per_s"], result["matmul_peak_flops"] = copy_bandwidth(DEVICE), matmul_peak(DEVICE)
    print(f"copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{result['matmul_peak_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    if DEVICE == "cuda":
        result["held"] = held_rates()
        print(f"as the board holds them: {result['held']['copy_bytes_per_s'] / 1e12:.2f} TB/s"
              f"{clock(result['held']['copy_gpu'])}, {result['held']['matmul_flops'] / 1e12:.0f} TFLOP/s"
              f"{clock(result['held']['matmul_gpu'])}", flush=True)
        result["decode_attention_split"] = decode_attention_split()
    with tempfile.TemporaryDirectory(dir=os.environ.get("CYLLM_BENCH_TMP")) as work:
        if not args.skip_equivalence:
            result["equivalence"] = await equivalence(SHAPES[names[0]], Path(work))
            print(f"equivalence: {result['equivalence']}", flush=True)
        result["shapes"] = []
        for index, name in enumerate(names):
            result["shapes"].append(await throughput(name, SHAPES[name], batches, Path(work),
                                                     result["copy_bandwidth_bytes_per_s"], result["matmul_peak_flops"],
                                                     prefix=index == 0 and not args.skip_prefix,
                                                     repeats=args.repeats, held=result.get("held")))
            RESULTS.mkdir(parents=True, exist_ok=True)  # written as it goes: a later shape may not fit the time
            (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
