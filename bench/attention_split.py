"""The paged decode-attention kernel alone, its contexts split in parts and not, for
bench/native_gpu.py: where splitting a long context across programs pays (attention.MAX_SPLITS)."""

from __future__ import annotations

import torch


def decode_attention_split() -> list[dict]:
    """The paged decode-attention kernel with its contexts split in parts and not, Llama-1B's heads,
    bf16, microseconds a call (20 calls in a CUDA graph, replayed 10 times)."""
    from worker.engines.native import attention

    block, kv_heads, heads, dim = 16, 8, 32, 64
    rows, default = [], attention.MAX_SPLITS
    try:
        for context in (256, 1024, 4096, 16384):
            for batch in (1, 4):
                blocks = batch * context // block
                k = torch.randn(blocks * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
                lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
                q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
                row = {"context": context, "batch": batch}
                for name, splits in (("unsplit_us", 1), ("split_us", default)):
                    attention.MAX_SPLITS = splits
                    for _ in range(3):
                        attention.decode_attention(q, k, v, tables, lens, block)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(20):
                            attention.decode_attention(q, k, v, tables, lens, block)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    row[name] = start.elapsed_time(end) / 200 * 1000
                rows.append(row)
                print(f"  decode attention, context {context:5d}, batch {batch}: {row['unsplit_us']:6.1f} us unsplit, "
                      f"{row['split_us']:6.1f} us split in up to {default} parts", flush=True)
    finally:
        attention.MAX_SPLITS = default
    return rows
