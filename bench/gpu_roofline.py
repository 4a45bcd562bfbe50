"""The GPU's ceilings and a step-time model for bench/native_gpu.py.

A decode step of batch B at context c must at least read the weights its matmuls use and the KV
cache of every sequence, and do their FLOPs; so its lower bound is

    max((weight bytes + B * c * kv bytes a token) / copy bandwidth,
        (2 * B * matmul weights + 4 * B * c * layers * heads * head_dim) / matmul peak)

with both ceilings measured on the device, not taken from a datasheet. That bound lets the KV
cache's bytes come while the products compute. In a layer the attention needs the qkv product and
the o product needs the attention, so run one after the other each has its own limit:
`serial_ms` = max(weight bytes / bandwidth, the products' FLOPs / peak) + KV bytes / bandwidth,
what a step without two parts of its batch side by side can reach. A prefill of T tokens is
bounded by its FLOPs alone (the weights are read once for thousands of tokens). DecodeProfile says
where a decode step's time goes, kernel by kernel, and how much of it the device sits idle;
device_floor, what the engine's step takes on the device with no host work between steps, and
floor_gaps, how much of that step the device sits idle between kernels.
"""

from __future__ import annotations

import time
from collections import Counter

import torch


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy of 4 GiB (256 MiB on a CPU)."""
    size = 1 << 32 if device == "cuda" else 1 << 28
    src = torch.empty(size // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    synchronize(device)
    seconds = (time.perf_counter() - started) / 10
    del src, dst
    return 2 * size / seconds


def matmul_peak(device: str) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data (1024^3 on a CPU), the best of 10."""
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n ** 3 / best


class StepModel:
    """The bytes and FLOPs of a Llama shape's steps, in bf16."""

    def __init__(self, shape: dict, bandwidth: float, peak: float):
        hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        heads, kv_heads, dim, vocab = (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
                                       shape["vocab_size"])
        per_layer = hidden * (heads * dim + 2 * kv_heads * dim) + heads * dim * hidden + 3 * hidden * inter
        self.layer_weights = layers * per_layer
        self.lm_head = vocab * hidden  # read whole every step; the embedding only by the rows looked up
        self.kv_bytes_per_token = layers * 2 * kv_heads * dim * 2
        self.attention_flops_per_context = 4 * layers * heads * dim  # QK^T and PV, per query and key
        self.bandwidth, self.peak = bandwidth, peak

    def decode(self, batch: int, context: float) -> dict:
        weight_bytes = 2 * (self.layer_weights + self.lm_head)
        kv_bytes = batch * context * self.kv_bytes_per_token
        products = 2 * batch * (self.layer_weights + self.lm_head)  # the matmuls' FLOPs
        read = weight_bytes + kv_bytes
        flops = products + batch * context * self.attention_flops_per_context
        bound = max(read / self.bandwidth, flops / self.peak)
        serial = max(weight_bytes / self.bandwidth, products / self.peak) + kv_bytes / self.bandwidth
        return {"bytes": read, "flops": flops, "bound_ms": bound * 1000, "serial_ms": serial * 1000,
                "bound_by": "bytes" if read / self.bandwidth >= flops / self.peak else "flops"}

    def prefill(self, batch: int, prompt: int) -> dict:
        """`batch` prompts of `prompt` tokens, causal attention, the output layer on each last token."""
        tokens = batch * prompt
        flops = (2 * tokens * self.layer_weights + 2 * batch * self.lm_head
                 + batch * prompt * (prompt + 1) / 2 * self.attention_flops_per_context)
        return {"tokens": tokens, "flops": flops, "bound_ms": flops / self.peak * 1000}


class DecodeProfile:
    """The torch profiler over a run, read from a mark on (set once every prompt is in): per decode
    step, the device's busy time by kernel (whichever thread launched it), the kernels run and the
    wall time, so the gap between them is the host's. It runs from before the requests go in: a
    profiler started at the mark would miss the tens of steps that run while it starts."""

    MARK = "cyllm.decode_start"

    def __init__(self, top: int = 12):
        from torch.profiler import ProfilerActivity, profile

        self.top = top
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.prof.__enter__()
        self.marked = None

    def mark(self) -> None:
        with torch.profiler.record_function(self.MARK):
            self.marked = time.perf_counter()

    def stop(self, steps: int) -> dict:
        torch.cuda.synchronize()
        wall = time.perf_counter() - self.marked
        self.prof.__exit__(None, None, None)
        events = self.prof.events()
        since = next(e.time_range.start for e in events if e.name == self.MARK)
        kernels: Counter[str] = Counter()
        launches = 0
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.start >= since:
                kernels[event.name[:90]] += event.time_range.elapsed_us()
                launches += 1
        busy = sum(kernels.values())
        largest = kernels.most_common(self.top)
        return {"steps": steps, "wall_ms_per_step": wall * 1000 / steps, "device_busy_ms_per_step": busy / 1000 / steps,
                "kernels_per_step": launches / steps,
                "top": [{"kernel": name, "ms_per_step": us / 1000 / steps, "share": us / busy} for name, us in largest],
                "rest_ms_per_step": (busy - sum(us for _, us in largest)) / 1000 / steps}


def device_floor(engine, batch: int, context: int | list[int], steps: int = 50) -> float:
    """ms a decode step of `batch` sequences at `context` tokens (or a list, each row's) takes on the
    device alone: the engine's CUDA graph for distinct rows, the argmax and the tokens' copy to the
    host, queued back to back with each step's tokens fed to the next on the device, as the engine
    launches ahead but with no engine thread between: the step when the host keeps ahead. A step
    beyond it is the host's. Each row reads a context of its own blocks, so every row's tokens
    must fit the cache. It writes K/V there and rows of the graphs' host inputs that the engine keeps track
    of: run it last, on an engine about to be unloaded."""
    step = _floor_step(engine, batch, context)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for index in range(-5, steps):  # five to warm up
        if index == 0:
            start.record()
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def floor_gaps(engine, batch: int, context: int, steps: int = 20) -> dict:
    """device_floor's steps under the profiler, ms a step: the time some kernel (or copy) runs
    (`kernels_ms`, the union of their spans: PDL's early launches overlap) and the device idle
    between them (`idle_ms`), split by the kernel after each gap: a library GEMM's (cuBLAS's, which
    no kernel before it can start early) or one of ours (launched with PDL where the device has it);
    `library_gemms_ms`, those GEMMs' own time (split-K reductions included). What the gaps cost is
    what a kernel fewer, or a GEMM that started early, could at most give back."""
    from torch.profiler import ProfilerActivity, profile

    step = _floor_step(engine, batch, context)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy = idle_gemm = idle_ours = gemms = 0.0
    reach = spans[0][0]
    for start, end, name in spans:
        library = name.startswith(("nvjet", "sm90_", "sm80_", "cutlass", "ampere_", "void cublas"))
        gemms += (end - start) if library else 0.0
        if start > reach:
            if library:
                idle_gemm += start - reach
            else:
                idle_ours += start - reach
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    per = 1000.0 * steps
    return {"kernels_ms": busy / per, "idle_ms": (idle_gemm + idle_ours) / per, "idle_before_library_gemms_ms":
            idle_gemm / per, "idle_before_ours_ms": idle_ours / per, "library_gemms_ms": gemms / per,
            "launches_per_step": len(spans) / steps}


def _floor_step(engine, batch: int, context: int):
    """device_floor's step as a function: the graph's run, its argmax and the tokens' copy, with
    the rows set up (each its own blocks) and their tokens fed from one step to the next."""
    from worker.engines.native.sequence import to_host
    from worker.engines.sampler import argmax

    graphs, block_size = engine.graphs, engine.blocks.block_size
    contexts = [context] * batch if isinstance(context, int) else context
    needs = [-(-row_context // block_size) for row_context in contexts]
    if sum(needs) > engine.blocks.num_blocks:
        raise ValueError(f"{sum(contexts)} tokens do not fit the cache's {engine.blocks.num_blocks} blocks")
    (ids, positions, slots, lens), tables = graphs.host.packed.numpy(), graphs.host.tables.numpy()
    first = 0
    for row, (row_context, need) in enumerate(zip(contexts, needs)):
        tables[row, :need] = range(first, first + need)
        first += need
        ids[row], positions[row], lens[row] = 2, row_context - 1, row_context
        slots[row] = tables[row, (row_context - 1) // block_size] * block_size + (row_context - 1) % block_size
    per_row = max(needs)
    tokens = [torch.full((batch,), 2, dtype=torch.long, device="cuda")]

    def step() -> None:
        graphs.copied.synchronize()  # the last run's inputs are read: the host buffer is free
        tokens[0] = argmax(graphs.run(batch, per_row, tokens[0], distinct=True))
        to_host(tokens[0])

    return step


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
