"""A decode step's parts on a GPU, each alone against its own bound.

bench/native_gpu.py puts whole steps against the step-time model; this says which part of a step
keeps it from its bound. For a Llama shape at each batch size, a layer's four products and the LM
head go through the engine's own routing (linear.RowLinear: gemv at one row, few_rows at a few,
cuBLAS past them; the gate/up projection gives its activation as the engine takes it, the o and
down projections come in parts along K where the engine splits them, RowLinear.split), and the
decode attention runs as the step's graphs run it (graphs.rotates_inside: the rotary embedding and
cache write inside the attention kernel; elsewhere their own kernel, not counted here). Each part
is timed in a CUDA graph over distinct copies of its weights or caches, ~200 MB of them, so that L2
holds none; its bound is max(bytes read and written / copy bandwidth, FLOPs / matmul peak), both
measured here (gpu_roofline.py). The plain products are timed: at 1-32 rows the engine's fused
forms (the norm inside the next product, the residual added in the last) differ by their epilogues.
The parts of a step add up to its products' and attention's time; what a step takes past that is
the norm and elementwise kernels, the edges between its kernels and the host.

Writes bench/results/gpu_parts.json and .png (--name: another file name).

    python bench/gpu_parts.py [--shapes llama-3.2-1b,llama-3.1-8b] [--batches 1,16,64,256]
                              [--context 256] [--name gpu_parts]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpu_roofline import StepModel, copy_bandwidth, matmul_peak  # noqa: E402
from bench.native_burst import DEVICE, SHAPES  # noqa: E402
from bench.native_gpu import RESULTS  # noqa: E402
from bench.structured import machine  # noqa: E402
from worker.engines.native import blas  # noqa: E402
from worker.engines.native.attention import decode_attention, rope_store_and_decode  # noqa: E402
from worker.engines.native.elementwise import Elementwise  # noqa: E402
from worker.engines.native.few_rows import FEW_ROWS_LIMIT  # noqa: E402
from worker.engines.native.linear import RowLinear  # noqa: E402

COPIES_BYTES = 200 << 20
"""Bytes of weights (or KV cache) a part's timed graph walks through, over distinct copies."""
BLOCK = 16
PARTS = ("qkv", "o", "gate_up", "down", "lm_head", "attention")


def timed(calls: list, reps: int = 10) -> float:
    """Microseconds a call, the calls replayed as one CUDA graph (run directly on a CPU), median of 5."""
    run = lambda: [call() for call in calls]  # noqa: E731
    if DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels and settles the allocator
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    run()
    times = []
    for _ in range(5):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            run()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) / reps / len(calls) * 1e6)
    return sorted(times)[2]


def copies(part_bytes: int, most: int = 512) -> int:
    return max(2, min(most, -(-COPIES_BYTES // part_bytes)))


def product(n: int, k: int, rows: int, gated: bool, adds: bool, ops: Elementwise) -> dict:
    """(N, K) weights' product of `rows` rows as the engine routes it; adds: its output is what the
    norm after it adds to the residual stream (o, down), in fp32 parts where the engine splits it."""
    linears = [RowLinear(torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16))
               for _ in range(copies(2 * n * k))]
    x, residual = (torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16) for width in (k, n))
    with blas.tuning():  # as the graphs' capture chooses whether cuBLAS runs it in parts (blas.parts)
        split = linears[0].split(x, residual) if adds else None  # (None where the engine runs it whole)
    parts = split.parts.shape[0] if split is not None else 0
    calls = [(lambda lin=lin: lin.activated(x, ops.silu_and_mul)) if gated
             else (lambda lin=lin: lin.split(x, residual)) if parts else (lambda lin=lin: lin(x))
             for lin in linears]
    epilogue = gated and x.is_cuda and linears[0].gives_activation(x.device, rows)  # few_rows gives the activation
    few = linears[0]._few_rows_config(x) is not None or (parts and rows <= FEW_ROWS_LIMIT)
    kernel = ("gemv" if rows == 1 else "few_rows" if few else "cublas") if DEVICE == "cuda" else "torch"
    silu = gated and kernel != "gemv" and not (few and epilogue)  # else the SiLU kernel after the product
    out = 4 * parts * rows * n if parts else 2 * rows * (n // 2 if gated else n)  # fp32 parts, or the product
    return {"us": timed(calls), "bytes": 2 * (n * k + rows * k) + out, "flops": 2 * rows * n * k,
            "kernel": kernel + (" + silu" if silu else "") + (f" in {parts} parts" if parts else "")}


def attention(shape: dict, batch: int, context: int) -> dict:
    """The decode attention of `batch` sequences of `context` tokens, blocks in random order."""
    from worker.engines.native.graphs import rotates_inside

    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    blocks = -(-context // BLOCK)
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    layers = copies(kv_bytes)
    slots = (batch * blocks + 1) * BLOCK
    k_cache, v_cache = (torch.randn(layers, slots, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    tables = torch.randperm(batch * blocks, device=DEVICE).int().view(batch, blocks)
    lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int64)
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=torch.bfloat16)
    new = torch.randn(batch, 2, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    angles = torch.rand(batch, 1, dim, device=DEVICE)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    at = tables[:, -1].long() * BLOCK + (context - 1) % BLOCK  # each row's new token's slot
    inside = DEVICE == "cuda" and rotates_inside(batch, kv_heads, dim)
    if inside:
        calls = [lambda i=i: rope_store_and_decode(q, new[:, 0], new[:, 1], cos, sin, k_cache[i], v_cache[i], at,
                                                   tables, lens, BLOCK) for i in range(layers)]
    else:
        calls = [lambda i=i: decode_attention(q, k_cache[i], v_cache[i], tables, lens, BLOCK) for i in range(layers)]
    return {"us": timed(calls), "bytes": kv_bytes, "flops": 4 * batch * context * heads * dim,
            "kernel": "decode, rope inside" if inside else "decode"}


def measure(name: str, batches: list[int], context: int, bandwidth: float, peak: float) -> dict:
    shape = SHAPES[name]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, dim, layers = (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
                                    shape["num_hidden_layers"])
    ops = Elementwise()
    if DEVICE == "cuda":
        ops.use_triton()
    weights = {"qkv": ((heads + 2 * kv_heads) * dim, hidden, False, False), "o": (hidden, heads * dim, False, True),
               "gate_up": (2 * inter, hidden, True, False), "down": (hidden, inter, False, True),
               "lm_head": (shape["vocab_size"], hidden, False, False)}
    model = StepModel(shape, bandwidth, peak)
    row = {"shape": name, **shape, "context": context, "batches": {}}
    for batch in batches:
        parts = {part: product(n, k, batch, gated, adds, ops) for part, (n, k, gated, adds) in weights.items()}
        parts["attention"] = attention(shape, batch, context)
        for part in parts.values():
            part["bound_us"] = max(part["bytes"] / bandwidth, part["flops"] / peak) * 1e6
            part["of_bound"] = part["bound_us"] / part["us"]
        per_step = {part: parts[part]["us"] * (1 if part == "lm_head" else layers) / 1000 for part in PARTS}
        bound = model.decode(batch, context)
        row["batches"][str(batch)] = {
            "parts": parts, "ms_per_step": per_step, "parts_ms": sum(per_step.values()),
            "parts_bound_ms": sum(parts[p]["bound_us"] * (1 if p == "lm_head" else layers) for p in PARTS) / 1000,
            "step_bound_ms": bound["bound_ms"]}
        print(f"{name} batch {batch}: parts {row['batches'][str(batch)]['parts_ms']:.3f} ms a step against a step "
              f"bound of {bound['bound_ms']:.3f}; " + ", ".join(
                  f"{p} {parts[p]['us']:.1f} us ({parts[p]['of_bound']:.0%}, {parts[p]['kernel']})" for p in PARTS),
              flush=True)
        del parts
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["shapes"]
    fig, axes = plt.subplots(2, len(rows), figsize=(6.5 * len(rows), 8), squeeze=False)
    for column, row in enumerate(rows):
        batches = list(row["batches"])
        x = range(len(batches))
        top, bottom = axes[0][column], axes[1][column]
        base = [0.0] * len(batches)
        for part in PARTS:
            ms = [row["batches"][b]["ms_per_step"][part] for b in batches]
            top.bar(x, ms, 0.6, bottom=base, label=part)
            base = [a + b for a, b in zip(base, ms)]
        top.plot(x, [row["batches"][b]["step_bound_ms"] for b in batches], "k_", markersize=40, label="step bound")
        top.set_xticks(list(x), [f"batch {b}" for b in batches])
        top.set_ylabel("ms a step, the parts back to back")
        top.set_title(f"{row['shape']} shape, bf16, {row['context']}-token contexts")
        top.legend(fontsize=8)
        width = 0.8 / len(PARTS)
        for i, part in enumerate(PARTS):
            bottom.bar([j - 0.4 + (i + 0.5) * width for j in x],
                       [row["batches"][b]["parts"][part]["of_bound"] for b in batches], width, label=part)
        bottom.set_xticks(list(x), [f"batch {b}" for b in batches])
        bottom.set_ylabel("each part's bound / its time")
        bottom.set_ylim(0, 1.1)
        bottom.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=256, help="tokens of each sequence's context")
    parser.add_argument("--name", default="gpu_parts", help="the results' file name, without .json / .png")
    args = parser.parse_args()
    result = {"benchmark": "gpu_parts", "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(DEVICE),
              "copy_bandwidth_bytes_per_s": copy_bandwidth(DEVICE), "matmul_peak_flops": matmul_peak(DEVICE)}
    print(f"copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{result['matmul_peak_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    result["shapes"] = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for name in args.shapes.split(","):
            result["shapes"].append(measure(name, [int(b) for b in args.batches.split(",")], args.context,
                                            result["copy_bandwidth_bytes_per_s"], result["matmul_peak_flops"]))
            (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
