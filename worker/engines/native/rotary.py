"""The rotary embedding of a step's new tokens, and their K/V written to the paged caches.

`rope_and_store` rotates q and k and writes k and v at each token's slot: a Triton kernel on CUDA,
the C++ kernel of kernels.py on CPUs once built, torch elsewhere. `rotate` is the rotation it, the
decode-attention kernel (attention.rope_store_and_decode) and the one-row qkv kernel's epilogue
(`rotate_and_store`, linear.RowLinear.rotating) use, so that the three give the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from worker.engines.native import kernels, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton; the paths below without it serve them
    triton = None


class Rope(NamedTuple):
    """What a qkv projection of one row needs to rotate q and k and write k and v (linear.RowLinear.rotating):
    cos, sin (1, 1, D) at the row's position; slots (1,); the layer's caches (slots, kv_heads, D);
    the widths of q and of k (and v) in the projection's output, [q | k | v]."""
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_width: int
    kv_width: int


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, and k and v written to the caches at `slots`. q (T, H, D), k and
    v (T, kv_heads, D), each with a unit stride in D; cos, sin (T, 1, D). Returns q and k rotated.
    On CUDA one Triton kernel: as four kernels (two rotations, two index copies) it was 8% of a
    batch-1 decode step of the Llama-1B shape; on CPUs the C++ one of kernels.py once built."""
    if q.is_cuda and triton is not None:
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)
        cos, sin = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
        early = pdl.supported(q.device)
        _rope_store_kernel[(tokens,)](
            q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), HEADS=heads, KV_HEADS=kv_heads,
            HEADS_PAD=triton.next_power_of_2(heads), KV_PAD=triton.next_power_of_2(kv_heads), HALF=dim // 2,
            PDL=early, launch_pdl=early)
        return q_out, k_out
    if q.device.type == "cpu" and kernels.loaded():
        return kernels.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    heads = q.shape[1]
    q, k = rotate(torch.cat((q, k), 1), cos, sin).split([heads, k.shape[1]], 1)  # one rotation: fewer calls
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q, k


if triton is not None:

    @triton.jit
    def rotate(x1, x2, cos1, sin1, cos2, sin2):
        """x's halves (fp32) rotated: x * cos + rotate_half(x) * sin."""
        return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2

    @triton.jit
    def rotate_half(x_ptr, cos1, sin1, cos2, sin2, rows, half, mask, HALF: tl.constexpr):
        """(rows, HALF) halves of x rotated, in fp32 (rotate)."""
        x1 = tl.load(x_ptr + rows[:, None] + half[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + rows[:, None] + HALF + half[None, :], mask=mask, other=0.0).to(tl.float32)
        return rotate(x1, x2, cos1, sin1, cos2, sin2)

    @triton.jit
    def rotate_and_store(out, out_ptr, cos1, cos2, sin1, sin2, slot, k_cache_ptr, v_cache_ptr, q_width, kv_width,
                         stride_cache, PAIRS: tl.constexpr, HALF: tl.constexpr):
        """A program's (2 * PAIRS,) outputs of a qkv projection (gemv's one-row kernel with a Rope),
        rounded to the output's dtype as the rope kernel reads them: rotated (q and k), stored, and k
        and v written at the row's slot. cos1 .. sin2: (PAIRS,) of the pairs' dimensions."""
        first, second = tl.split(tl.permute(tl.reshape(out.to(tl.float32), (2, PAIRS)), (1, 0)))
        pair = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
        column = pair // HALF * (2 * HALF) + pair % HALF  # of the first of each pair; a program's all lie in one head
        start = tl.program_id(0) * PAIRS // HALF * (2 * HALF)
        if start < q_width + kv_width:
            first, second = rotate(first, second, cos1, sin1, cos2, sin2)
        first, second = first.to(out_ptr.dtype.element_ty), second.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + column, first)
        tl.store(out_ptr + column + HALF, second)
        if start >= q_width:
            cached = slot * stride_cache + column - q_width
            if start < q_width + kv_width:
                tl.store(k_cache_ptr + cached, first)
                tl.store(k_cache_ptr + cached + HALF, second)
            else:
                tl.store(v_cache_ptr + cached - kv_width, first)
                tl.store(v_cache_ptr + cached - kv_width + HALF, second)

    @triton.jit
    def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
                           slots_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                           stride_cs, stride_ch, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                           HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0)
        half = tl.arange(0, HALF)
        # Before the wait: the rotations and the slot come from the step's inputs, which no kernel
        # of the layer writes (pdl.py).
        cos1 = tl.load(cos_ptr + token * stride_cos + half).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + token * stride_cos + HALF + half).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + token * stride_cos + half).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + token * stride_cos + HALF + half).to(tl.float32)[None, :]
        slot = tl.load(slots_ptr + token).to(tl.int64)
        pdl.wait_for_previous(PDL)
        heads = tl.arange(0, HEADS_PAD)
        mask = (heads < HEADS)[:, None]
        out1, out2 = rotate_half(q_ptr + token * stride_qt, cos1, sin1, cos2, sin2, heads * stride_qh, half, mask, HALF)
        q_out = q_out_ptr + token * HEADS * 2 * HALF + heads[:, None] * 2 * HALF + half[None, :]
        tl.store(q_out, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_out + HALF, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
        kv = tl.arange(0, KV_PAD)
        mask = (kv < KV_HEADS)[:, None]
        out1, out2 = rotate_half(k_ptr + token * stride_kt, cos1, sin1, cos2, sin2, kv * stride_kh, half, mask, HALF)
        k_out = k_out_ptr + token * KV_HEADS * 2 * HALF + kv[:, None] * 2 * HALF + half[None, :]
        cached = k_cache_ptr + slot * stride_cs + kv[:, None] * stride_ch + half[None, :]
        out1, out2 = out1.to(k_out_ptr.dtype.element_ty), out2.to(k_out_ptr.dtype.element_ty)
        tl.store(k_out, out1, mask=mask)
        tl.store(k_out + HALF, out2, mask=mask)
        tl.store(cached, out1, mask=mask)
        tl.store(cached + HALF, out2, mask=mask)
        dims = tl.arange(0, 2 * HALF)
        value = tl.load(v_ptr + token * stride_vt + kv[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(v_cache_ptr + slot * stride_cs + kv[:, None] * stride_ch + dims[None, :], value, mask=mask)
