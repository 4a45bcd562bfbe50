// SiLU-and-multiply of the MLP on CPUs, one pass over each row (kernels.py compiles this).
//
// torch's roundings: silu(gate) is computed in fp32 and rounded to the dtype before up multiplies it.
// In torch this was three ops a layer (a chunk, silu, a product) and two intermediate tensors; a
// plain-loop version was slower than torch's (its exp was not vectorized), hence vec.h's vexp.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace cyllm::CYLLM_OPS {
namespace {

template <typename T>
void silu_rows(const T* gate_up, T* out, int64_t rows, int64_t size, int64_t stride) {
  at::parallel_for(0, rows * size, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t row = i / size, col = i % size, stop = std::min(end - row * size, size);
      const T *gate = gate_up + row * stride, *up = gate + size;
      T* o = out + row * size;
      int64_t c = col;
      for (; c + W <= stop; c += W) {
        const fvec g = load(gate + c);
        fvec act = g / (fvec(1.f) + vexp(fvec(0.f) - g));
        if constexpr (!std::is_same_v<T, float>) {  // rounded to the dtype, as torch's silu returns it
          alignas(64) T rounded[W];
          store(rounded, act);
          act = load(rounded);
        }
        store(o + c, act * load(up + c));
      }
      for (; c < stop; ++c) {
        const float g = static_cast<float>(gate[c]);
        o[c] = T(static_cast<float>(T(g / (1.f + std::exp(-g)))) * static_cast<float>(up[c]));
      }
      i = row * size + stop;
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up (rows, 2 * size), a unit stride");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = at::empty({rows, size}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    silu_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, size, gate_up.stride(0));
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "fp32 or bf16");
    silu_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, size, gate_up.stride(0));
  }
  return out;
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::silu_and_mul);
}
