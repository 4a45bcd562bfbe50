"""Prefill attention over the paged cache on CUDA, for every sequence of a step with tokens cached
before its new ones (a shared prefix found in the cache, a later chunk of a long prompt), in one
Triton kernel.

Torch's SDPA took one call a sequence and a layer, with the context gathered from the cache and an
explicit causal mask: 256 requests after a cached system prompt made 4,096 calls a step for the
Llama-1B shape, about half a millisecond of host time each. Here one program takes BM queries of
one sequence and one query head, walks that sequence's block table BN keys at a time (keys past the
block's last query left out) with an online softmax, and writes its rows of the output. The new
tokens' keys and values are in the cache already (rope_and_store runs first).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None

BN = 64


def paged_prefill_meta(starts: list[int], query_lens: list[int], context_lens: list[int], tables: list[list[int]],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(starts, query_lens, context_lens (S,) int32, tables (S, max_blocks) int32, longest query):
    made once a step for every layer's call, in one copy that does not wait for the device (a
    tensor made from each list was a copy and a wait of its own: four a step). Each part starts
    16 bytes in and the tables' width is a multiple of 16: Triton compiles a variant of the kernel
    per pointer aligned so or not, and per integer divisible by 16 or not (~0.4 s each)."""
    count, width = len(starts), -(-max(map(len, tables)) // 16) * 16
    part = -(-count // 4) * 4  # int32s: 16 bytes
    packed = np.zeros(3 * part + count * width, dtype=np.int32)
    for index, values in enumerate((starts, query_lens, context_lens)):
        packed[index * part:index * part + count] = values
    rows = packed[3 * part:].reshape(count, width)
    for row, table in zip(rows, tables):
        row[:len(table)] = table
    on_device = torch.from_numpy(packed).to(device, non_blocking=True)
    return (on_device[:count], on_device[part:part + count], on_device[2 * part:2 * part + count],
            on_device[3 * part:].view(count, width), max(query_lens))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: tuple,
                  block_size: int) -> None:
    """Writes out[rows] for the sequences `meta` names (paged_prefill_meta); q, out (T, H, D)."""
    starts, query_lens, context_lens, tables, longest = meta
    heads, dim = q.shape[1], q.shape[2]
    bm = 16 if longest <= 16 else 64
    grid = (starts.shape[0], heads, triton.cdiv(longest, bm))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, tables, starts, query_lens, context_lens, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1), tables.stride(0), dim ** -0.5,
        GROUP=heads // k_cache.shape[1], BLOCK_SIZE=block_size, D=dim, BM=bm, BN=BN,
        IEEE=q.dtype == torch.float32, num_warps=4)


def supports(device: torch.device, head_dim: int) -> bool:
    """Triton on CUDA, a power-of-two head size of at least 16 (tl.dot's tiles)."""
    return device.type == "cuda" and triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, query_lens_ptr, context_lens_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_table, scale,
                              GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, IEEE: tl.constexpr):
        seq, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        query_len = tl.load(query_lens_ptr + seq)
        if block * BM >= query_len:
            return
        start, context = tl.load(starts_ptr + seq), tl.load(context_lens_ptr + seq)
        kv_head = head // GROUP
        rows = block * BM + tl.arange(0, BM)  # queries of this chunk
        dims = tl.arange(0, D)
        row_ok = rows < query_len
        q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_ok[:, None],
                    other=0.0)
        positions = context - query_len + rows  # each query sees the keys up to its own position
        end = context - query_len + tl.minimum(query_len, (block + 1) * BM)
        best = tl.full((BM,), float("-inf"), tl.float32)
        total = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        for first in range(0, end, BN):
            keys = first + tl.arange(0, BN)
            key_ok = keys < end
            blocks = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_ok, other=0)
            slots = (blocks * BLOCK_SIZE + keys % BLOCK_SIZE).to(tl.int64)
            k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=key_ok[:, None],
                        other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where((keys[None, :] <= positions[:, None]) & key_ok[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))  # finite: every query sees key 0
            weights = tl.exp(scores - new_best[:, None])
            shrink = tl.exp(best - new_best)
            total = total * shrink + tl.sum(weights, 1)
            v = tl.load(v_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=key_ok[:, None],
                        other=0.0)
            if IEEE:
                acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v)
            best = new_best
        tl.store(out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
