"""Long contexts for bench/native_gpu.py: the paged decode-attention kernel alone, its contexts split
in parts and not (where splitting a long context across programs pays: paged_decode.split_parts), and
the engine's decode step at long contexts against the step's bound."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LONG_CONTEXTS = ((1, 4096), (1, 16384), (1, 32768), (4, 16384), (16, 8192))
"""(batch, context) of the decode steps measured at long contexts: one long chat or RAG prompt, a few,
and some at a middling length (the short ones are native_gpu.py's own runs)."""
MIXED_CONTEXTS = ((64, 1, 32768, 256), (256, 1, 32768, 256), (256, 4, 8192, 256), (64, 1, 32768, 3000))
"""(batch, long rows, their context, the others' context) of the decode steps measured with a few long
contexts among shorter ones, as a busy worker holds one long RAG prompt among chats (or among RAG
prompts of a few thousand tokens: every context past paged_decode.LONG_CONTEXT)."""


def decode_attention_split() -> list[dict]:
    """The paged decode-attention kernel with its contexts split in parts (as a step of that longest
    context launches it: paged_decode.LONG_CONTEXT) and not, Llama-1B's heads, bf16, microseconds a
    call (20 calls in a CUDA graph, replayed 10 times, on one cache: up to 33 MB, within L2)."""
    from worker.engines.native import attention, paged_decode

    block, kv_heads, heads, dim = 16, 8, 32, 64
    rows, default = [], (paged_decode.MAX_SPLITS, paged_decode.SHORT_SPLITS)
    try:
        for context in (256, 1024, 4096, 16384):
            long = context > paged_decode.LONG_CONTEXT
            for batch in (1, 4):
                blocks = batch * context // block
                k = torch.randn(blocks * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
                lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
                q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
                row = {"context": context, "batch": batch, "parts": paged_decode.split_parts(batch, kv_heads, long)}
                for name, splits in (("unsplit_us", (1, 1)), ("split_us", default)):
                    paged_decode.MAX_SPLITS, paged_decode.SHORT_SPLITS = splits
                    for _ in range(3):
                        attention.decode_attention(q, k, v, tables, lens, block, long=long)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(20):
                            attention.decode_attention(q, k, v, tables, lens, block, long=long)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    row[name] = start.elapsed_time(end) / 200 * 1000
                rows.append(row)
                print(f"  decode attention, context {context:5d}, batch {batch}: {row['unsplit_us']:6.1f} us unsplit, "
                      f"{row['split_us']:6.1f} us split in up to {row['parts']} parts", flush=True)
    finally:
        paged_decode.MAX_SPLITS, paged_decode.SHORT_SPLITS = default
    return rows


async def long_context_steps(folder: Path, shape: dict, model) -> list[dict]:
    """The decode step of `batch` sequences at `context` tokens (LONG_CONTEXTS), and of a few long ones
    among short ones (MIXED_CONTEXTS), as the device runs it (gpu_roofline.device_floor: the engine's
    CUDA graph back to back), ms a step, against the step's bound (gpu_roofline.StepModel, at the
    rows' mean context); an engine of its own, whose contexts reach the longest."""
    from bench.gpu_roofline import device_floor
    from bench.native_burst import unload
    from worker.config_loader import load_config
    from worker.engines.hosted import settle
    from worker.engines.native.engine import NativeEngine

    cases = [(batch, [context] * batch) for batch, context in LONG_CONTEXTS] + [
        (batch, [context] * long + [others] * (batch - long)) for batch, long, context, others in MIXED_CONTEXTS]
    longest = max(max(contexts) for _, contexts in cases)
    blocks = max(sum(contexts) for _, contexts in cases) // 16 + 64 + max(batch for batch, _ in cases)
    config = load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(folder), "engine.dtype": "bfloat16",
        "engine.max_model_len": str(longest + 256),
        "engine.args": json.dumps({"max_num_seqs": max(batch for batch, _ in cases), "speculation": "requested",
                                   "max_kv_blocks": blocks})})
    engine = NativeEngine(config)
    await engine.load_model()
    settle()
    rows = []
    try:
        for batch, contexts in cases:
            floor = device_floor(engine, batch, contexts)
            bound = model.decode(batch, sum(contexts) / batch)
            others = min(contexts)
            long = sum(context > others for context in contexts)
            rows.append({"batch": batch, "context": max(contexts), "step_ms": floor, "bound_ms": bound["bound_ms"],
                         "of_bound": bound["bound_ms"] / floor, "bound_by": bound["bound_by"]})
            if 0 < long < batch:
                rows[-1].update(long_rows=long, short_context=others)
            what = (f"{long} at {max(contexts)} tokens, the others at {others}" if 0 < long < batch
                    else f"at {max(contexts)} tokens")
            print(f"  {shape['num_hidden_layers']}-layer shape, batch {batch} {what}: {floor:.3f} ms a step on the device, "
                  f"{rows[-1]['of_bound']:.0%} of its {bound['bound_by']} bound {bound['bound_ms']:.3f} ms", flush=True)
    finally:
        await unload(engine)
    return rows
