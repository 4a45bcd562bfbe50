"""The small element-wise steps every layer runs: RMS norm (after a residual add), rotary embedding,
SiLU-and-multiply; and the step's first, the tokens' embedding rows with their rotary angles.

Each is written once in plain torch, which is what CPUs run. On CUDA, where they are a dozen tiny
kernels a layer that at small batches cost more than the layer's GEMMs, norm and SiLU are one Triton
kernel each (rotary is fused into the cache write, in attention.py). They are plain Triton rather
than torch.compile: a compiled function cost ~0.3 ms of Python a call on an H100 host, which made a
128-token prefill of the Llama-1B shape take 15-20 ms (49 calls) against 1.7 ms of GPU work. Roundings
follow HF's: the sum and the normalized value are rounded to the model's dtype before the weight
multiplies them, as torch does in eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engines.native import kernels, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's norm in fp32 is HF's x * rsqrt(mean(x^2) + eps) to the bit, in one call instead of five.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its norm): the residual stream and the next sublayer's input."""
    x = x + residual
    return x, rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's rotate_half layout. x (T, H, D); cos, sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def embed(ids: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor,
          rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the tokens' rows of the embedding (T, hidden), cos and sin at their positions, each (T, 1, D)):
    ids, positions (T,); rotations (2, positions, D), LlamaModel.cache_rotations'."""
    cos, sin = rotations.index_select(1, positions)[:, :, None, :]
    return F.embedding(ids, weight), cos, sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, size), or (parts, rows, size) with a residual: fp32 parts of a product (few_rows'
    SPLIT), added up and rounded to the residual's dtype first."""
    split = x.dim() == 3
    assert not split or residual is not None
    rows, size = x.shape[-2:]
    out = torch.empty(rows, size, dtype=residual.dtype if split else x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else x
    block = triton.next_power_of_2(size)
    early = pdl.supported(x.device)
    _norm_kernel[(rows,)](x, residual if residual is not None else x, weight, total, out, x.stride(-2),
                          residual.stride(0) if residual is not None else 0, size, eps, x.shape[0] if split else 1,
                          x.stride(0), HAS_RESIDUAL=residual is not None, SPLIT=split,
                          PARTS=triton.next_power_of_2(x.shape[0]) if split else 1, BLOCK=block, PDL=early,
                          num_warps=8 if block >= 4096 else 4, launch_pdl=early)
    return total, out


def _silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
    early = pdl.supported(gate_up.device)
    _silu_mul_kernel[(rows, triton.cdiv(size, 1024))](gate_up, out, gate_up.stride(0), size, BLOCK=1024, PDL=early,
                                                      num_warps=4, launch_pdl=early)
    return out


def _embed_triton(ids: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor,
                  rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """embed() in one kernel: torch's two index kernels took 4 us of a batch-1 decode step on an
    H200 (Llama-1B shape) and 22 us at batch 16, each at the head of the step's chain."""
    tokens, (hidden, dim) = ids.shape[0], (weight.shape[1], rotations.shape[-1])
    x = torch.empty(tokens, hidden, dtype=weight.dtype, device=weight.device)
    angles = torch.empty(2, tokens, dim, dtype=rotations.dtype, device=weight.device)
    block = triton.next_power_of_2(hidden)
    early = pdl.supported(ids.device)
    _embed_kernel[(tokens,)](ids, positions, weight, rotations, x, angles, angles[1], weight.stride(0),
                             rotations.stride(0), rotations.stride(1), hidden, dim, BLOCK=block,
                             DIM=triton.next_power_of_2(dim), PDL=early, num_warps=8 if block >= 4096 else 4,
                             launch_pdl=early)
    return x, angles[0][:, None, :], angles[1][:, None, :]


class Elementwise:
    """The functions a model's layers call: torch's everywhere, Triton's once `use_triton()` (CUDA),
    the C++ norm and SiLU once `use_cpu_kernels()` (kernels.py). Inputs are (tokens, features) with a unit
    stride in the features."""

    def __init__(self):
        self.rms_norm, self.add_rms_norm, self.rotate, self.silu_and_mul = rms_norm, add_rms_norm, rotate, silu_and_mul
        self.embed = embed

    def use_triton(self) -> None:
        if triton is None:
            return
        self.embed = _embed_triton
        self.rms_norm = lambda x, weight, eps: _norm_triton(x, None, weight, eps)[1]
        self.add_rms_norm = _norm_triton
        self.silu_and_mul = _silu_and_mul_triton

    def use_cpu_kernels(self) -> None:
        self.rms_norm = lambda x, weight, eps: kernels.add_rms_norm(x, None, weight, eps)[1]
        self.add_rms_norm = kernels.add_rms_norm
        self.silu_and_mul = kernels.silu_and_mul


if triton is not None:

    @triton.jit
    def _norm_kernel(x_ptr, residual_ptr, weight_ptr, total_ptr, out_ptr, stride_x, stride_r, size, eps, parts,
                     stride_part, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, PARTS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row: total = x + residual (stored, in total's dtype), out = weight * norm(total). SPLIT: x
        is the sum of its fp32 parts, rounded to total's dtype (as few_rows rounds a product)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no kernel writes it
        pdl.wait_for_previous(PDL)
        if SPLIT:  # every part's row in one load, then their sum
            part = tl.arange(0, PARTS)
            x = tl.sum(tl.load(x_ptr + part[:, None] * stride_part + row * stride_x + cols[None, :],
                               mask=(part < parts)[:, None] & mask[None, :], other=0.0), 0)
            x = x.to(total_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(total_ptr.dtype.element_ty)
            tl.store(total_ptr + row * size + cols, x, mask=mask)
            x = x.to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * size + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _embed_kernel(ids_ptr, positions_ptr, weight_ptr, rotations_ptr, x_ptr, cos_ptr, sin_ptr, stride_w,
                      stride_side, stride_position, hidden, dim, BLOCK: tl.constexpr, DIM: tl.constexpr,
                      PDL: tl.constexpr):
        """One token: its embedding row, and the cos and sin rows at its position."""
        pdl.wait_for_previous(PDL)  # the ids may be the step before's, copied in on the device
        token = tl.program_id(0)
        row = tl.load(ids_ptr + token).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        tl.store(x_ptr + token * hidden + cols, tl.load(weight_ptr + row * stride_w + cols, mask=cols < hidden),
                 mask=cols < hidden)
        d = tl.arange(0, DIM)
        angle = rotations_ptr + position * stride_position + d
        tl.store(cos_ptr + token * dim + d, tl.load(angle, mask=d < dim), mask=d < dim)
        tl.store(sin_ptr + token * dim + d, tl.load(angle + stride_side, mask=d < dim), mask=d < dim)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_row, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out[row, cols] = silu(gate) * up, gate and up the two halves of the row."""
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < size
        gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_row + size + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * size + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
