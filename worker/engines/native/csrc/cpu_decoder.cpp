// A decode step's decoder layers on CPUs in one call (kernels.py compiles this).
//
// The same layer as model.py's DecoderLayer, for steps whose tokens are all decodes: the norms,
// rotary embedding, attention and SiLU of this folder's kernels, and the linear layers through the
// ops model.py's wrappers call (cpu_linear.cpp). Run from Python, the
// ~15 calls and module hops of a layer cost ~100 us: 3 ms of a 25 ms SmolLM2 step at batch 8.
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace cyllm::CYLLM_OPS {

namespace {

// x (T, in) times a weight laid out at load by linear.py: quantized where it has scales
// (QuantLinear), else oneDNN's blocked layout, or the plain weight where oneDNN lacks its dtype
// (PackedLinear).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                  const std::optional<at::Tensor>& bias) {
  if (scales) return quantized_linear(x, weight, *scales, bias);
  return weight.is_mkldnn() ? packed_linear(x, weight, bias) : unpacked_linear(x, weight, bias);
}

}  // namespace

// x (T, hidden), one decode token per sequence. Per layer: norms (input, post-attention); weights,
// scales and biases (qkv, o, gate_up, down). k_caches, v_caches (layers, slots, kv_heads, D); cos,
// sin (T, D); slots (T,) int64; tables (T, width), lens (T,) int32. Returns the last layer's
// (MLP output, residual), as model.py's layers hand them to the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& embedded, at::TensorList norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& biases,
    const at::Tensor& k_caches, const at::Tensor& v_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens, int64_t heads, int64_t block_size,
    double eps) {
  const int64_t layers = k_caches.size(0), tokens = embedded.size(0);
  TORCH_CHECK(k_caches.dim() == 4 && v_caches.sizes() == k_caches.sizes(), "caches (layers, slots, kv_heads, D)");
  TORCH_CHECK((int64_t)norms.size() == 2 * layers && (int64_t)weights.size() == 4 * layers &&
                  (int64_t)scales.size() == 4 * layers && (int64_t)biases.size() == 4 * layers,
              "2 norms and 4 linear layers a layer");
  const int64_t kv_heads = k_caches.size(2), dim = k_caches.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  at::Tensor x = embedded, residual, h;
  for (int64_t l = 0; l < layers; ++l) {
    auto lin = [&](const at::Tensor& in, int64_t i) { return linear(in, weights[4 * l + i], scales.get(4 * l + i), biases.get(4 * l + i)); };
    std::tie(residual, h) = add_rms_norm(x, l ? std::optional<at::Tensor>(residual) : std::nullopt, norms[2 * l], eps);
    const at::Tensor qkv = lin(h, 0);
    const at::Tensor k_cache = k_caches.select(0, l), v_cache = v_caches.select(0, l);
    auto rotated = rope_and_store(qkv.narrow(1, 0, heads * dim).view({tokens, heads, dim}),
                                  qkv.narrow(1, heads * dim, kv_heads * dim).view({tokens, kv_heads, dim}),
                                  qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({tokens, kv_heads, dim}),
                                  cos, sin, k_cache, v_cache, slots);
    const at::Tensor attended = paged_decode(std::get<0>(rotated), k_cache, v_cache, tables, lens, block_size, scale);
    std::tie(residual, h) = add_rms_norm(lin(attended.view({tokens, heads * dim}), 1), residual, norms[2 * l + 1], eps);
    x = lin(silu_and_mul(lin(h, 2)), 3);
  }
  return {x, residual};
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, Tensor(a!) k_caches, "
        "Tensor(b!) v_caches, Tensor cos, Tensor sin, Tensor slots, Tensor tables, Tensor lens, int heads, int block_size, "
        "float eps) -> (Tensor, Tensor)");
  m.impl("decode_layers", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::decode_layers);
  m.impl("decode_layers", c10::DispatchKey::MkldnnCPU, &cyllm::CYLLM_OPS::decode_layers);  // oneDNN's packed weights are its tensors
}
