// The kernels' C++ entry points, shared by their registrations and the decoder stack (cpu_decoder.cpp).
#pragma once

#include <ATen/core/Tensor.h>

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

}  // namespace cyllm::CYLLM_OPS
