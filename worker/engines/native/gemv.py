"""The linear products of one row on CUDA (a batch-1 decode step), as a Triton matrix-vector kernel.

At batch 1 a decode step is these products and little else: each reads its weight once for 2 flops
a weight, so what counts is how near the read comes to the memory's bandwidth. For the Llama-1B
shapes on an H100, cuBLAS's kernels for one row took 7.0 / 6.4 / 25.4 / 16.3 / 189 us (qkv, o,
gate_up, down with its split-K reduce, lm_head); this kernel 6.2 / 4.8 / 23.7 / 13.4 / 166, 10% of
the step (each timed in a CUDA graph, over copies of the weight larger than L2). Each program
streams its BN rows of W in (BN, BK) tiles, read once and so marked evict-first. Launched with PDL
(pdl.py), it reads its first tile of W while the kernel before it still runs: a 16-layer chain of
the 1B shape's kernels at batch 1 took 874 us with 2048-wide tiles (a whole row read ahead), 891
with 1024 and 996 with 512. Asking L2 for a program's whole slice of W ahead (`prefetch.global.L2`)
made the same chain slower, 1,047 against 933 us. few_rows.py is its counterpart for a few rows;
linear.RowLinear picks between them and cuBLAS.
"""

from __future__ import annotations

import torch

from worker.engines.native import pdl
from worker.engines.native.rotary import Rope

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None


_NAMES: dict[torch.device, str] = {}


def for_device(table: dict, device: torch.device):
    """table's entry whose key is a part of the device's name (as vLLM keys its Triton configs), or
    None; the name looked up once a device."""
    if device not in _NAMES:
        _NAMES[device] = torch.cuda.get_device_name(device)
    return next((entry for key, entry in table.items() if key in _NAMES[device]), None)


ROPE_INSIDE = {"H200": 2048}
"""By a part of the device's name: the deepest K whose one-row qkv projection rotates and writes the
cache itself (RowLinear.rotating) instead of leaving it to the rope kernel. On an H200, engines
alternated in one process, ms a step at batch 1: the Llama-1B shape (K 2,048) 0.7992 against 0.8060
(five rounds), the Llama-8B shape (K 4,096) 3.978 against 3.881 (three), so it keeps the kernel.
That kernel lets the attention kernel after it start only once it has finished: started early under
PDL, as the other kernels start theirs, the attention took ~3 us a layer longer (1B: 0.877 against
0.828 ms a step, the device's time in attention 144 us a step against 93 + 21 of the rope kernel's),
as it had at batch 1 inside the attention kernel (graphs.DISTINCT_MIN_ROWS). The same late start
for few_rows' qkv products at 2-64 rows was slower (batch 2 / 16: 1.104 / 1.117 against 1.061 / 1.072)."""


def rope_inside(device: torch.device, k: int) -> bool:
    """Whether a one-row qkv projection of depth K takes the rotary embedding inside on this device."""
    return k <= (for_device(ROPE_INSIDE, device) or 0)


NORMED_MAX = 8192
"""Widest row whose norm gemv_after_norm takes (each program holds the whole row once)."""


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
         rope: Rope | None = None) -> torch.Tensor:
    """x (1, K) @ weight (N, K).T (+ bias): (1, N) in x's dtype, accumulated in fp32. gated: weight
    is [gate | up] (N = 2I), and the result silu(gate) * up, (1, I), rounded as the product then
    elementwise.silu_and_mul round it (the same to the bit, a kernel fewer). rope: the output is a
    qkv projection's, rotated and written to the caches (RowLinear.rotating)."""
    return _gemv(x, weight, bias, gated=gated, rope=rope)


def gemv_after_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None, rope: Rope | None = None,
                    gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, gemv(rms_norm(total) * norm_weight, weight, bias, gated)), total = x + residual, both
    (1, K): a layer's norm inside its next projection (a kernel fewer; every program normalizes the
    row, program 0 writes total). The row's sum of squares adds up in another order than the norm
    kernel's, so the normalized row may differ from it in the last bit."""
    total = torch.empty_like(x)
    return total, _gemv(x, weight, bias, gated=gated, norm=(residual, norm_weight, total, eps), rope=rope)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
          norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
          rope: Rope | None = None) -> torch.Tensor:
    """The matrix-vector kernel's launch; norm: (residual, norm weight, total out, eps)."""
    n, k = weight.shape
    out = torch.empty(1, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    rows, tile, warps, stages = row_config(x.device, k) or (
        8 if n >= 3072 else 4,  # the fastest for the shapes above: more programs for the narrow ones
        2048,  # with PDL a whole 2048-wide row is read before the wait
        8, 4 if k >= 8192 else 3)
    tile = min(tile, triton.next_power_of_2(k))
    early = pdl.supported(x.device)
    residual, norm_weight, total, eps = norm or (x, x, x, 0.0)
    if rope is not None:
        head_dim = rope.cos.shape[-1]  # a program's rows are rows // 2 pairs (d, d + D / 2) of a head
        assert rows <= 16 and head_dim % 16 == 0 and n == rope.q_width + 2 * rope.kv_width
        assert rope.k_cache.stride()[1:] == (head_dim, 1) and rope.v_cache.stride() == rope.k_cache.stride()
        assert rope.cos.stride(-1) == rope.sin.stride(-1) == 1
        cos, sin, slots, k_cache, v_cache = rope.cos, rope.sin, rope.slots, rope.k_cache, rope.v_cache
        q_width, kv_width, stride_cache = rope.q_width, rope.kv_width, rope.k_cache.stride(0)
    else:
        head_dim, (cos, sin, slots, k_cache, v_cache), q_width, kv_width, stride_cache = 2, (x,) * 5, 0, 0, 0
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x, weight, bias if bias is not None else weight, out, residual, norm_weight, total, eps, n, k, weight.stride(0),
        cos, sin, slots, k_cache, v_cache, q_width, kv_width, stride_cache,
        HAS_BIAS=bias is not None, EVEN_K=k % tile == 0, GATED=gated, NORM=norm is not None,
        ROW=triton.next_power_of_2(k), BN=rows, BK=tile, ROPE=rope is not None, HALF=head_dim // 2, PDL=early,
        NEXT_EARLY=rope is None,  # (ROPE_INSIDE says why)
        num_warps=warps, num_stages=stages, launch_pdl=early)
    return out


ROW_CONFIGS = {
    "H200": ((0, 2048, (4, 1024, 4, 4)), (2049, 4096, (4, 2048, 8, 3)), (8193, 1 << 30, (8, 1024, 4, 4))),
    "H100": ((4096, 1 << 30, (4, 2048, 8, 3)),),
}
"""gemv's (rows, tile, warps, stages) by a part of the device's name (as vLLM keys its Triton
configs): (narrowest K, widest K, config) entries, the first whose range takes the product's K;
other devices and K take the kernel's own config (the H100's, before these entries).
- H200, K up to 2,048: the Llama-1B shapes' qkv, gate_up and LM head were fastest so (a sweep, each
  timed in a CUDA graph: the step's GEMVs 693 -> 645 us); alternated three times in one process, a
  batch-1 step of the 1B shape took 0.848 against 0.899 ms. On an H100 the same config took the 1B
  step from 1.067 to 1.068 ms and the 8B one from 5.46 to 5.51. SmolLM2's products (K 576 and
  1536), within it, were not timed with it.
- H200, K of 2,049-4,096 (the 8B shape's, which took the entry above before: 4.305 -> 4.244 ms a
  step): a sweep of each product over 8-16 layers' weights in a CUDA graph, with PDL, us a layer
  against that entry: qkv 12.30 against 12.98, gate_up 51.98 against 53.31, LM head 227.3 against
  233.0, o 8.73 against 8.63.
- H200, K past 8,192: the 8B shape's down projection (K 14,336), 27.8 against the kernel's own 34.4
  us a layer. The 1B shape's (K 8,192) keeps the kernel's own: 9.32 against 11.20 with this one.
  Through the engine the 8B shape's batch-1 step took 4.110 ms with the last two entries (a run of
  bench/native_gpu.py; 4.246 in the run before, another H200 host).
- H100: the 8B shape's products (K 4096 and its down projection's 14336). Swept in the forward's
  CUDA graph at batch 1 (320-token context) against the kernel's own config: 5,528 -> 5,417 us a
  step (-6.7 us from the K 4096 ones, -86 from the down projection); through the engine, alternated
  twice in one process, 5.462 / 5.463 -> 5.365 / 5.366 ms. The 1B shape's down projection (K 8192)
  moved by under 1 us. Narrower products keep the kernel's own: the best for the 1B shape's (K 2048,
  (2, 1024, 4, 3): 1,073 -> 1,058 us) made SmolLM2's step (K 576 and 1536) 50 us slower.
Gated products (a gate/up projection giving its activation) take their K's entry too."""

def row_config(device: torch.device, k: int) -> tuple[int, int, int, int] | None:
    """ROW_CONFIGS' config for this device and K, or None."""
    entries = for_device(ROW_CONFIGS, device) or ()
    return next((config for narrowest, widest, config in entries if narrowest <= k <= widest), None)


if triton is not None:
    from worker.engines.native.rotary import rotate_and_store

    @triton.jit
    def output_rows(BN: tl.constexpr, N, GATED: tl.constexpr):
        """A program's BN rows of W and which of them exist; GATED: BN / 2 pairs (gate j, up j) of a
        [gate | up] weight, gate and up side by side."""
        if GATED:
            pair = tl.program_id(0) * (BN // 2) + tl.arange(0, BN) // 2
            return pair + tl.arange(0, BN) % 2 * (N // 2), pair < N // 2
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        return cols, cols < N

    @triton.jit
    def silu_of_pairs(sums, dtype: tl.constexpr):
        """(R, BN) sums of output_rows' GATED pairs -> (R, BN / 2) silu(gate) * up in dtype, each step
        rounded as the product's output then _silu_mul_kernel round it."""
        sums = sums.to(dtype).to(tl.float32)
        gate, up = tl.split(tl.reshape(sums, (sums.shape[0], sums.shape[1] // 2, 2)))
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype)

    @triton.jit
    def _row_tile(x_ptr, ks, K, residual_ptr, norm_ptr, scale, NORM: tl.constexpr):
        """x's values at ks, in fp32; NORM: norm * rms_norm(x + residual), `scale` the row's 1 / rms,
        rounded as _norm_kernel rounds."""
        mask = ks < K
        if NORM:
            total = tl.load(x_ptr + ks, mask=mask, other=0.0).to(tl.float32)
            total += tl.load(residual_ptr + ks, mask=mask, other=0.0).to(tl.float32)
            normed = (total.to(x_ptr.dtype.element_ty).to(tl.float32) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            weight = tl.load(norm_ptr + ks, mask=mask, other=0.0).to(tl.float32)
            return (weight * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
        return tl.load(x_ptr + ks, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_ptr, total_ptr, eps, N, K, stride_w,
                     cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, q_width, kv_width, stride_cache,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                     ROW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                     PDL: tl.constexpr, NEXT_EARLY: tl.constexpr):
        if ROPE:  # the program's BN // 2 pairs (d, d + HALF) of one head: rows [d's..., (d + HALF)'s...]
            pair = tl.program_id(0) * (BN // 2) + tl.arange(0, BN) % (BN // 2)
            rows = pair // HALF * (2 * HALF) + tl.arange(0, BN) // (BN // 2) * HALF + pair % HALF
            valid = rows < N
        else:
            rows, valid = output_rows(BN, N, GATED)
        # The first tile of W, read before the wait: no kernel writes the weights.
        ks = tl.arange(0, BK)
        mask = valid[:, None]
        if not EVEN_K:
            mask = mask & (ks[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        if ROPE:  # the row's slot, a step input (pdl.py), and where the program's pairs lie
            slot = tl.load(slots_ptr).to(tl.int64)
            half = (tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)) % HALF
        pdl.wait_for_previous(PDL, NEXT_EARLY)
        if ROPE:  # its rotation, which the step's first kernel writes: read now, used once the sums are in
            cos1 = tl.load(cos_ptr + half).to(tl.float32)
            cos2 = tl.load(cos_ptr + HALF + half).to(tl.float32)
            sin1 = tl.load(sin_ptr + half).to(tl.float32)
            sin2 = tl.load(sin_ptr + HALF + half).to(tl.float32)
        scale = 1.0
        if NORM:  # the whole row's sum of squares first, as _norm_kernel takes it
            row = tl.arange(0, ROW)
            total = tl.load(x_ptr + row, mask=row < K, other=0.0).to(tl.float32)
            total += tl.load(residual_ptr + row, mask=row < K, other=0.0).to(tl.float32)
            total = total.to(x_ptr.dtype.element_ty)
            if tl.program_id(0) == 0:
                tl.store(total_ptr + row, total, mask=row < K)
            total = total.to(tl.float32)
            scale = tl.rsqrt(tl.sum(total * total, axis=0) / K + eps)
        acc = w.to(tl.float32) * _row_tile(x_ptr, ks, K, residual_ptr, norm_ptr, scale, NORM)[None, :]
        for start in range(BK, K, BK):
            ks = start + tl.arange(0, BK)
            mask = valid[:, None]
            if not EVEN_K:
                mask = mask & (ks[None, :] < K)
            w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * _row_tile(x_ptr, ks, K, residual_ptr, norm_ptr, scale, NORM)[None, :]
        out = tl.sum(acc, 1)
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        if ROPE:
            rotate_and_store(out.to(out_ptr.dtype.element_ty), out_ptr, cos1, cos2, sin1, sin2, slot, k_cache_ptr,
                              v_cache_ptr, q_width, kv_width, stride_cache, BN // 2, HALF)
        elif GATED:
            pairs = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
            act = silu_of_pairs(tl.reshape(out, (1, BN)), out_ptr.dtype.element_ty)
            tl.store(out_ptr + pairs, tl.reshape(act, (BN // 2,)), mask=pairs < N // 2)
        else:
            tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=valid)
