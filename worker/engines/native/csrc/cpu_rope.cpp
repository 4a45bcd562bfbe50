// Rotary embedding of q and k and the write of k and v into the paged caches, on CPUs, in one pass
// over each token (kernels.py compiles this).
//
// HF's rotate_half layout and its roundings: in bf16 x * cos and rotate_half(x) * sin are each
// rounded to bf16 before their sum is, as torch's eager ops do. In torch this was 8 ops a layer
// (a cat, the rotation's slices, negation, products and sum, two index copies).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <initializer_list>
#include <tuple>

#include "ops.h"

namespace cyllm::CYLLM_OPS {
namespace {

// One head of D values: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]);
// T(...) rounds to the dtype (nothing for fp32).
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float turned = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const float a = static_cast<float>(T(static_cast<float>(x[d]) * static_cast<float>(cos[d])));
    const float b = static_cast<float>(T(turned * static_cast<float>(sin[d])));
    out[d] = T(a + b);
  }
}

template <typename T>
void rope_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
               const at::Tensor& sin, at::Tensor& q_out, at::Tensor& k_out, at::Tensor& k_cache, at::Tensor& v_cache,
               const int64_t* slots) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T *qo = q_out.data_ptr<T>(), *ko = k_out.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T *c = cp + t * cos.stride(0), *s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h)
        rotate<T>(qp + t * q.stride(0) + h * q.stride(1), c, s, qo + (t * heads + h) * dim, dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* rotated = ko + (t * kv_heads + h) * dim;
        rotate<T>(kp + t * k.stride(0) + h * k.stride(1), c, s, rotated, dim);
        T* k_slot = kc + (slots[t] * kv_heads + h) * dim;
        T* v_slot = vc + (slots[t] * kv_heads + h) * dim;
        const T* v_row = vp + t * v.stride(0) + h * v.stride(1);
        for (int64_t d = 0; d < dim; ++d) {
          k_slot[d] = rotated[d];
          v_slot[d] = v_row[d];
        }
      }
    }
  });
}

}  // namespace

// q (T, H, D), k and v (T, kv_heads, D), unit stride in D; cos and sin (T, D); caches (slots,
// kv_heads, D); slots (T,) int64. Returns q and k rotated, contiguous.
std::tuple<at::Tensor, at::Tensor> rope_and_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                                  at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q (T, H, D), k and v (T, kv_heads, D)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.size(2) % 2 == 0, "a unit stride in an even D");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  cos.stride(1) == 1 && sin.stride(1) == 1, "cos and sin (T, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2), "caches (slots, kv_heads, D)");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == q.size(0), "a slot per token, int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0), "a slot outside the cache");
  auto q_out = at::empty(q.sizes(), q.options());
  auto k_out = at::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kBFloat16) {
    rope_rows<c10::BFloat16>(q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slot);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 or bf16");
    rope_rows<float>(q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slot);
  }
  return {q_out, k_out};
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("rope_and_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> (Tensor, Tensor)");
  m.impl("rope_and_store", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::rope_and_store);
}
