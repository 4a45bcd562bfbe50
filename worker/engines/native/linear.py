"""Linear layers for CPUs: the weight laid out once, at load, for the kernel that reads it.

A decode step on a CPU is mostly its linear layers reading their weights, so these decide its speed:
- `PackedLinear`: the full-precision weight in oneDNN's blocked layout (fp32 or bf16).
- `Int4Linear` (engine.args.quantization=int4): weight-only 4-bit, a scale and an offset per group
  of 32 inputs (the scheme of GGUF's Q4_1), through torch's int4 CPU kernel with bf16 activations.
  A quarter of bf16's bytes: on the 2-core machine SmolLM2 decoded one stream at 9.2 ms a token
  against 17.8 in bf16, but batch 8 ran at 327 tok/s against 371 and a 128-token prompt took 248 ms
  against 148 (bench/results/engines_cpu.json, medians of 3 rounds): the kernel's time grows with
  every row, bf16's GEMM less so.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32
"""Inputs per int4 scale/offset. The embedded model comes from a Q4_1 GGUF, whose blocks are 32
inputs quantized over their own min..max: requantizing over the same groups lands on its grid."""


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN lays out for its CPU kernels once, at load. torch's plain
    CPU linear repacks the weight on every call of more than one row: at batch 8 that was 60% of a
    SmolLM2 decode step in fp32, and the packed kernel is also faster in bf16 and at batch 1."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)  # a batch-size hint; any batch runs
        self.bias = linear.bias
        self.weight_bytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class Int4Linear(nn.Module):
    """Weight-only int4: w = (q - 8) * scale + zero per group of GROUP inputs, q in 0..15, with the
    group's min at q = 0 and its max at q = 15. Activations bf16 (torch's fp32 path of this kernel
    is not vectorized: 150 ms a step)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        rows, inputs = weight.shape
        groups = weight.view(rows, inputs // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-10)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(rows, inputs)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel takes scale and zero in bf16: with the scale rounded, the zero that fits the
        # group best is its mean residual.
        scale = scale.bfloat16().float()
        zero = (groups - (q.view(groups.shape) - 8) * scale[..., None]).mean(-1)
        # (groups, rows, 2): per group and row, scale and the value q = 8 stands for.
        self.scales = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = linear.bias
        self.weight_bytes = self.packed.numel() * self.packed.element_size() + self.scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        return y if self.bias is None else y + self.bias

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % GROUP == 0
