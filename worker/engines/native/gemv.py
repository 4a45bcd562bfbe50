"""Linear layers for one row on CUDA (a batch-1 decode step), as a Triton matrix-vector kernel.

At batch 1 a decode step is these products and little else: each reads its weight once for 2 flops
a weight, so what counts is how near the read comes to the memory's bandwidth. For the Llama-1B
shapes on an H100, cuBLAS's kernels for one row took 7.0 / 6.4 / 25.4 / 16.3 / 189 us (qkv, o,
gate_up, down with its split-K reduce, lm_head); this kernel 6.2 / 4.8 / 23.7 / 13.4 / 166, 10% of
the step (each timed in a CUDA graph, over copies of the weight larger than L2). Each program
streams its BN rows of W in (BN, BK) tiles, read once and so marked evict-first.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None


class RowLinear(nn.Module):
    """`linear`, through the kernel when the input is one row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1 or not x.is_cuda or x.stride(-1) != 1:  # the kernel reads x as one contiguous row
            return self.linear(x)
        return gemv(x, self.linear.weight, self.linear.bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (1, K) @ weight (N, K).T (+ bias): (1, N) in x's dtype, accumulated in fp32."""
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    rows = 8 if n >= 3072 else 4  # the fastest for the shapes above: more programs for the narrow ones
    tile = min(1024, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % tile == 0, BN=rows, BK=tile, num_warps=8, num_stages=4 if k >= 8192 else 3)
    return out


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros((BN, BK), tl.float32)
        for start in range(0, K, BK):
            ks = start + tl.arange(0, BK)
            mask = rows[:, None] < N
            if not EVEN_K:
                mask = mask & (ks[None, :] < K)
            w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0) if not EVEN_K else tl.load(x_ptr + ks)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, 1)
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)
