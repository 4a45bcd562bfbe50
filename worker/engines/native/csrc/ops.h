// The kernels' C++ entry points, shared by their registrations and the decoder stack (cpu_decoder.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>

// kernels.py builds one library per instruction set, each defining CYLLM_OPS (cyllm_avx2, ...): its
// ops are torch.ops.<CYLLM_OPS>.*, its C++ lives in cyllm::<CYLLM_OPS>, so that two libraries
// loaded side by side (the tests compare them) share no symbol.
#ifndef CYLLM_OPS
#error "CYLLM_OPS names the op namespace of the instruction set this library is built for (kernels.py)"
#endif

namespace cyllm::CYLLM_OPS {

// q (B, H, D); caches (slots, kv_heads, D); tables (B, width) and lens (B,) int32. Returns (B, H, D).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, int64_t block_size, double scale);

// (x + residual, weight * norm(x + residual)); without a residual the total is x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);

// q (T, H, D), k and v (T, kv_heads, D); cos and sin (T, D); slots (T,) int64. Returns q and k rotated.
std::tuple<at::Tensor, at::Tensor> rope_and_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                                  at::Tensor v_cache, const at::Tensor& slots);

// gate_up (T, 2I) -> silu(gate) * up (T, I).
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// x (T, in) times a weight in oneDNN's blocked layout (linear.py's PackedLinear), and that layout
// made from a (out, in) weight for about `tokens` rows of x.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t tokens);

// x (T, in) times a plain (out, in) weight of a dtype oneDNN does not run on this CPU (bf16 without
// AVX-512): torch's GEMV for a few rows, a GEMM on the weight widened to fp32 for many.
at::Tensor unpacked_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// From this many rows of x on, a GEMM on the weight widened to full precision beats a GEMV on it.
constexpr int64_t kGemmTokens = 16;

// Whether oneDNN runs GEMMs in this dtype on this CPU; x (T, in) times a (rows, in) weight that
// fill(first, n, wide) writes in x's dtype a chunk of rows at a time (cpu_linear.cpp).
bool onednn_runs(at::ScalarType dtype);
using Widen = std::function<void(int64_t first, int64_t n, at::Tensor& wide)>;
at::Tensor widened_linear(const at::Tensor& x, int64_t rows, const std::optional<at::Tensor>& bias, const Widen& fill);

// x (T, in) fp32 or bf16 times 4- or 8-bit weights (linear.py's QuantLinear) -> (T, out) of x's dtype
// (cpu_quant.cpp).
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias);

}  // namespace cyllm::CYLLM_OPS
