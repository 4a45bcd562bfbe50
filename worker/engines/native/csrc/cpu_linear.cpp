// Linear layers on CPUs in full precision (kernels.py compiles this), as linear.py's PackedLinear
// lays them out at load: oneDNN's blocked layout, called boxed (its ops have no C++ headers); where
// oneDNN does not run the model's dtype (bf16 without AVX-512), the plain weight: torch's GEMV for a
// few rows, and for many a GEMM on the weight widened to fp32 (with torch's bf16 GEMM a 128-token
// prompt took 601 ms under forced AVX2; 324 so).
#include <ATen/Context.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops.h"

namespace cyllm::CYLLM_OPS {
namespace {

constexpr int64_t kScratchBytes = 4 << 20;  // of the weight widened at a time

}  // namespace

// Whether oneDNN runs GEMMs in this dtype on this CPU (bf16: with AVX-512 or AMX; not when the
// worker limits oneDNN to AVX2, engine.cpu_isa).
bool onednn_runs(at::ScalarType dtype) {
  if (!at::hasMKLDNN()) return false;
  if (dtype == at::kFloat) return true;
  static const bool bf16 = [] {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "");
    std::vector<c10::IValue> stack;
    op.callBoxed(&stack);
    return stack[0].toBool();
  }();
  return dtype == at::kBFloat16 && bf16;
}

// x (T, in) times a weight that fill(first, n, wide) widens to x's dtype a chunk of rows at a time,
// into a buffer the calling thread keeps (a fresh allocation of that size was mapped anew on each
// call, and its page faults cost more than the GEMM), each chunk laid out for oneDNN's kernel where
// oneDNN runs the dtype (torch's plain fp32 GEMM took 1.6x as long at 128 tokens).
at::Tensor widened_linear(const at::Tensor& x, int64_t rows, const std::optional<at::Tensor>& bias, const Widen& fill) {
  const int64_t tokens = x.size(0), inputs = x.size(1);
  const int64_t chunk = std::min(rows, std::max<int64_t>(64, kScratchBytes / (inputs * x.element_size()) / 64 * 64));
  static thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.numel() < chunk * inputs)
    scratch = at::empty({chunk * inputs}, x.options());
  const auto typed = bias ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : std::nullopt;
  auto y = at::empty({tokens, rows}, x.options());
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t n = std::min(chunk, rows - first);
    at::Tensor wide = scratch.narrow(0, 0, n * inputs).view({n, inputs});
    fill(first, n, wide);
    const auto part_bias = typed ? std::optional<at::Tensor>(typed->narrow(0, first, n)) : std::nullopt;
    y.narrow(1, first, n).copy_(onednn_runs(x.scalar_type()) ? packed_linear(x, pack_linear_weight(wide, tokens), part_bias)
                                                              : at::linear(x, wide, part_bias));
  }
  return y;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t tokens) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  std::vector<c10::IValue> stack{weight, tokens};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor unpacked_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "x (T, in) and a contiguous weight (out, in) of its dtype");
  if (x.size(0) < kGemmTokens || onednn_runs(x.scalar_type())) return at::linear(x, weight, bias);
  const auto wide = widened_linear(x.to(at::kFloat), weight.size(0), bias, [&](int64_t first, int64_t n, at::Tensor& out) {
    out.copy_(weight.narrow(0, first, n));
  });
  return wide.to(x.scalar_type());
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("unpacked_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("unpacked_linear", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::unpacked_linear);
}
