// RMS norm after the residual add, on CPUs, in one pass over each row (kernels.py compiles this).
//
// The same roundings as HF and as elementwise.py's torch and Triton paths: the sum is rounded to the
// model's dtype (the residual stream), the norm is computed in fp32 over it, the normalized value is
// rounded to the dtype before the weight multiplies it. In torch that was 7-8 small ops a norm
// (casts, pow, mean, rsqrt, mul), 61 norms a SmolLM2 step.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace cyllm::CYLLM_OPS {
namespace {

template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* total, T* out, int64_t rows, int64_t size,
               int64_t stride_x, int64_t stride_r, float eps) {
  // Rows are independent; a decode step's few rows run on the calling thread.
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(size);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * stride_x;
      float* v = sums.data();
      if (residual != nullptr) {
        const T* rr = residual + r * stride_r;
        T* tr = total + r * size;
        for (int64_t i = 0; i < size; ++i) {
          T sum = T(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          tr[i] = sum;
          v[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < size; ++i) v[i] = static_cast<float>(xr[i]);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) squares += v[i] * v[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
      T* o = out + r * size;
      for (int64_t i = 0; i < size; ++i) o[i] = T(static_cast<float>(weight[i]) * static_cast<float>(T(v[i] * inv)));
    }
  });
}

}  // namespace

// (x + residual, weight * norm(x + residual)); without a residual (the first layer) the total is x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x (rows, size) with a unit stride in size");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "a weight of x's size and dtype");
  const int64_t rows = x.size(0), size = x.size(1);
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "a residual of x's shape and dtype");
  }
  auto out = at::empty({rows, size}, x.options());
  auto total = residual ? at::empty({rows, size}, x.options()) : x;
  const int64_t stride_r = residual ? residual->stride(0) : 0;
  if (x.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                 total.data_ptr<T>(), out.data_ptr<T>(), rows, size, x.stride(0), stride_r, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "fp32 or bf16");
    norm_rows<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                     total.data_ptr<float>(), out.data_ptr<float>(), rows, size, x.stride(0), stride_r,
                     static_cast<float>(eps));
  }
  return {total, out};
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::add_rms_norm);
}
