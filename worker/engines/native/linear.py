"""Linear layers for CPUs: the weight laid out once, at load, for the kernel that reads it.

A decode step on a CPU is mostly its linear layers reading their weights, so these decide its speed:
- `PackedLinear`: the full-precision weight in oneDNN's blocked layout (fp32 or bf16), or bf16 as
  it is where oneDNN has no bf16.
- `QuantLinear` (engine.args.quantization=int4): weight-only, 4 bits for the decoder layers and 8
  for the output layer, a scale (and offset) per group of 32 inputs as GGUF's Q4_1 / Q8_0 blocks,
  through csrc/cpu_quant.cpp's integer dot products.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.engines.native import kernels

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
