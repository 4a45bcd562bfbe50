"""Linear layers: each product taken to the kernel that reads its weight fastest.

On CUDA, `RowLinear` sends one row to gemv.py's kernel, a few rows to few_rows.py's and more to
torch's (cuBLAS, through the front end blas.py chose for the shape). A decode step on a CPU is
mostly its linear layers reading their weights, laid out once, at load, for the kernel that reads
them:
- `PackedLinear`: the full-precision weight in oneDNN's blocked layout (fp32 or bf16), or bf16 as
  it is where oneDNN has no bf16.
- `QuantLinear` (engine.args.quantization=int4): weight-only, 4 bits for the decoder layers and 8
  for the output layer, a scale (and offset) per group of 32 inputs as GGUF's Q4_1 / Q8_0 blocks,
  through csrc/cpu_quant.cpp's integer dot products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.engines.native import blas, kernels, pdl
from worker.engines.native.few_rows import FEW_ROWS_LIMIT, HANDOFF_MOST_ROWS, few_rows, few_rows_config, split_config
from worker.engines.native.gemv import NORMED_MAX, gemv, gemv_after_norm, rope_inside, triton
from worker.engines.native.rotary import Rope

GROUP = 32
"""Inputs per int4 scale/offset. The embedded model comes from a Q4_1 GGUF, whose blocks are 32
inputs quantized over their own min..max: requantizing over the same groups lands on its grid."""


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN lays out for its CPU kernels once, at load. torch's plain
    CPU linear repacks the weight on every call of more than one row: at batch 8 that was 60% of a
    SmolLM2 decode step in fp32, and the packed kernel is also faster in bf16 and at batch 1.

    Where oneDNN does not run the dtype (bf16 on CPUs without AVX-512, or with oneDNN limited to
    AVX2), the weight stays as it is, in half fp32's bytes: a decode step reads it through torch's
    bf16 GEMV (2.05x fp32's tokens/s under forced AVX2), and a prompt through a GEMM on the weight
    widened to fp32 a chunk at a time (kernels.unpacked_linear; torch's own bf16 GEMM is slow there)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if self.supports(weight.dtype) else weight
        self.bias = linear.bias
        self.weight_bytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if kernels.loaded():
            return kernels.unpacked_linear(x, self.packed, self.bias)
        return nn.functional.linear(x, self.packed, self.bias)

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether oneDNN runs this dtype's GEMMs here, the weight then in its layout."""
        return torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.weight.dtype in (torch.float32, torch.bfloat16)


class QuantLinear(nn.Module):
    """Weight-only quantization per group of GROUP inputs, as GGUF lays its blocks out:
    4 bits (Q4_1): w = d * q + m, q in 0..15, the group's min at q = 0 and its max at q = 15, m then
    refitted as the group's mean residual; 8 bits (Q8_0): w = d * q, q in -127..127. Run by
    kernels.quantized_linear (csrc/cpu_quant.cpp, integer dot products with the activations
    quantized to 8 bits); without the kernels, by torch on the weight widened at each call."""

    def __init__(self, linear: nn.Linear, bits: int):
        super().__init__()
        weight = linear.weight.detach().float()
        rows, inputs = weight.shape
        groups = weight.view(rows, inputs // GROUP, GROUP)
        if bits == 4:
            low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
            d = ((high - low) / 15).clamp(min=1e-7)
            q = torch.round((groups - low) / d).clamp(0, 15)
            d = d.half().float()  # the offset fitted to the scale as stored
            self.scales = torch.cat([d, (groups - q * d).mean(-1, keepdim=True)], -1).half()
            q = q.to(torch.uint8)
            self.packed = (q[..., :GROUP // 2] | q[..., GROUP // 2:] << 4).view(rows, inputs // 2)
        else:
            d = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-7)
            self.packed = torch.round(groups / d).clamp(-127, 127).to(torch.int8).view(rows, inputs)
            self.scales = d.half()
        self.bits = bits
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # added to the fp32 sums
        self.weight_bytes = self.packed.numel() + self.scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.loaded():
            return kernels.quantized_linear(x, self.packed, self.scales, self.bias)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.dequantized().to(x.dtype), bias)

    def dequantized(self) -> torch.Tensor:
        rows = self.packed.shape[0]
        if self.bits == 4:
            nibbles = self.packed.view(rows, -1, GROUP // 2)
            q = torch.cat([nibbles & 15, nibbles >> 4], -1).float()
            scales = self.scales.float()
            return (q * scales[..., :1] + scales[..., 1:]).view(rows, -1)
        return (self.packed.view(rows, -1, GROUP).float() * self.scales.float()).view(rows, -1)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % GROUP == 0


@dataclass(frozen=True)
class Sum:
    """The residual stream's next value as a product's kernel gave it (RowLinear.adding): total
    (rows, width), the product plus the stream; squares (programs, rows) fp32, the parts of each
    row's sum of squares; weighted, total times the next norm's weight (`norm`), rounded, or None:
    what the next projection's kernel reads to take that norm (RowLinear.after_norm)."""
    total: torch.Tensor
    squares: torch.Tensor
    weighted: torch.Tensor | None
    norm: torch.Tensor | None


@dataclass(frozen=True)
class Parts:
    """A product split along K (RowLinear.split): parts (S, rows, N) fp32, which the norm after it
    adds up, rounds and adds to the residual stream (elementwise's norm kernel)."""
    parts: torch.Tensor

    def rows(self, index: torch.Tensor) -> Parts:
        return Parts(self.parts[:, index])


class RowLinear(nn.Module):
    """`linear` on CUDA: one row through gemv's kernel, a few rows in half precision (with PDL)
    through few_rows', others through torch's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._through_kernel(x, gated=False)
        return out if out is not None else blas.linear(self.linear, x)

    def activated(self, x: torch.Tensor, silu_and_mul) -> torch.Tensor:
        """silu_and_mul(linear(x)) of a gate/up projection ([gate | up] weights): where gemv or
        few_rows takes x, inside its kernel, each program's outputs pairs of a gate and its up
        column; else the product, then silu_and_mul."""
        out = self._through_kernel(x, gated=True)
        return out if out is not None else silu_and_mul(self(x))

    def after_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, rope: Rope | None = None,
                           gated: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + residual, linear(rms_norm(x + residual))) for one row in one kernel, rounded as
        elementwise.add_rms_norm rounds; None where that does not apply. `rope`: see rotating();
        gated: the projection's activation, as activated() gives it."""
        if (x.shape[0] != 1 or not x.is_cuda or x.stride(-1) != 1 or residual.stride(-1) != 1
                or x.shape[1] > NORMED_MAX):
            return None
        return gemv_after_norm(x, residual, norm_weight, eps, self.linear.weight, self.linear.bias, rope, gated)

    def rotating(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """A qkv projection of one row (takes_rope) with its rotary embedding and cache write
        inside: q and k rotated as rotary.rope_and_store rotates them, k and v written at the
        row's slot (rotary.rotate_and_store)."""
        return gemv(x, self.linear.weight, self.linear.bias, rope=rope)

    def takes_rope(self, x: torch.Tensor, head_dim: int) -> bool:
        """Whether rotating() takes x and pays: one contiguous row on CUDA, heads whose halves a
        program's pairs of outputs divide (it takes up to 8 pairs), a device and K of ROPE_INSIDE."""
        return (triton is not None and x.shape[0] == 1 and x.is_cuda and x.stride(-1) == 1 and head_dim % 16 == 0
                and rope_inside(x.device, self.linear.weight.shape[1]))

    def adding(self, x: torch.Tensor, residual: torch.Tensor, next_norm: torch.Tensor | None = None) -> Sum | None:
        """linear(x) + residual from few_rows' kernel, with the parts of each row's sum of squares and,
        given the weight of the norm after it, the sum times that weight; None where few_rows does
        not take x or it has more than HANDOFF_MOST_ROWS rows (the norm after it then adds, in its
        own kernel)."""
        if x.shape[0] > HANDOFF_MOST_ROWS or residual.stride() != (self.linear.weight.shape[0], 1):
            return None
        config = self._few_rows_config(x)
        if config is None:
            return None
        return Sum(*few_rows(x, self.linear.weight, self.linear.bias, *config, residual=residual, next_norm=next_norm),
                   next_norm)

    def split(self, x: torch.Tensor, residual: torch.Tensor) -> Parts | None:
        """linear(x) as Parts, for the norm after it to add to `residual`: where few_rows splits x's
        product (few_rows.FEW_ROWS_SPLIT), or past its rows where cuBLAS runs it faster in parts
        (blas.parts); else None."""
        weight = self.linear.weight
        if self._few_rows_fit(x):
            config = split_config(x.device, *weight.shape, x.shape[0])
            return Parts(few_rows(x, weight, self.linear.bias, *config[:4], parts=config[4])) if config else None
        if not x.is_cuda or x.shape[0] <= FEW_ROWS_LIMIT:
            return None
        parts = blas.parts(self.linear, x, residual)
        return Parts(blas.split(weight, x, parts)) if parts > 1 else None

    def after_norm(self, x: Sum, eps: float, silu_and_mul=None) -> torch.Tensor | None:
        """linear(rms_norm(x.total) * x.norm) in few_rows' kernel, from x.weighted and the sums of
        squares, no norm kernel before it (few_rows.HANDOFF_MOST_ROWS; rounded otherwise than that path);
        with silu_and_mul, the activation of a gate/up projection as activated() gives it. None
        where few_rows does not take x, or x has no weighted rows."""
        config = self._few_rows_config(x.total)
        if config is None or x.weighted is None:
            return None
        gated = silu_and_mul is not None and self.gives_activation(x.total.device, x.total.shape[0])
        out = few_rows(x.weighted, self.linear.weight, self.linear.bias, *config, gated=gated, normed=(x.squares, eps))
        return silu_and_mul(out) if silu_and_mul is not None and not gated else out

    def _through_kernel(self, x: torch.Tensor, gated: bool) -> torch.Tensor | None:
        """x's product (gated: its activation, as activated() gives it) through gemv or few_rows, or
        None where torch's linear (and the SiLU kernel) serve it better."""
        if not x.is_cuda or x.stride(-1) != 1:  # the kernels read x's rows as contiguous
            return None
        if x.shape[0] == 1:
            return gemv(x, self.linear.weight, self.linear.bias, gated)
        if gated and not self.gives_activation(x.device, x.shape[0]):
            return None
        config = self._few_rows_config(x)
        return few_rows(x, self.linear.weight, self.linear.bias, *config, gated=gated) if config is not None else None

    def _few_rows_config(self, x: torch.Tensor) -> tuple[int, int, int, int] | None:
        """few_rows' config for x's product, or None where few_rows does not take it."""
        return few_rows_config(x.device, *self.linear.weight.shape, x.shape[0]) if self._few_rows_fit(x) else None

    @staticmethod
    def _few_rows_fit(x: torch.Tensor) -> bool:
        """Whether x is what few_rows' kernel reads: 2 to FEW_ROWS_LIMIT contiguous rows in half
        precision on a CUDA device of PDL."""
        return (x.is_cuda and x.stride(-1) == 1 and 1 < x.shape[0] <= FEW_ROWS_LIMIT
                and x.dtype in (torch.bfloat16, torch.float16) and pdl.supported(x.device))

    def gives_activation(self, device: torch.device, rows: int) -> bool:
        """Whether few_rows' kernel, where it takes `rows` rows, gives this gate/up projection's
        activation ([gate | up] weights, (N, K)): not where the down projection after it, (K, N / 2),
        runs whole in few_rows' kernel too; there the product, then the SiLU kernel. On an H200, the Llama-1B
        shape's engines alternated in one process (ms a step): at batch 32 / 64, the down projection
        through cuBLAS, 1.1110 / 1.1984 -> 1.0925 / 1.1713 (five rounds); at batch 4 / 8 / 16, the
        down projection through few_rows, 1.0282 / 1.0453 / 1.0164 -> 1.1300 / 1.1462 / 1.1297
        (three rounds; 1.13-1.15 at 16 in three calls before), though [gate_up, down] alone in a
        CUDA graph took 32.3 us a layer against 33.3."""
        n, k = self.linear.weight.shape[1], self.linear.weight.shape[0] // 2  # the down projection's
        return few_rows_config(device, n, k, rows) is None  # as _few_rows_config takes it
