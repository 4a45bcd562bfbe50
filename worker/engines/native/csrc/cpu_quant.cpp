// Linear layers with 4- or 8-bit weights on CPUs (kernels.py compiles this), as linear.py's
// QuantLinear lays them out at load, per row and group of 32 inputs:
//   4 bits: w = d * q + m, q in 0..15, two to a byte (byte j: q[j] low, q[j + 16] high), GGUF's Q4_1;
//   8 bits: w = d * q, q in -127..127, GGUF's Q8_0;
// d and m fp16, as GGUF keeps them (an fp32 pair was a third of the bytes a 4-bit step read).
// The activations are quantized to 8 bits per group of 32 on the way in (a = s * p, p in -127..127,
// GGUF's Q8_1, which also keeps s * sum(p) for the 4-bit offset), so a group's dot product is
// d * s * sum(q * p) + m * s * sum(p): 32 byte products summed in integers, one float multiply-add.
// That reads a quarter (or half) of bf16's bytes and does the arithmetic in 8-bit lanes, 32 a
// 256-bit instruction, where torch's int4 kernel widens every weight to float first. For many
// tokens the widened weight's GEMM wins again (cpu_linear.cpp): its cost grows less with every token.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace cyllm::CYLLM_OPS {
namespace {

constexpr int64_t kGroup = 32;
constexpr int kRows = 4;  // rows that share one load of an activation group

// On x86 the 4-bit kernel takes two groups a step: a 32-byte load holds both groups' weights, the
// low nibbles (elements 0..15 of each) and the high ones (16..31) each one register, so the
// activations are laid out to match, per pair of groups: g's 0..15, g+1's 0..15, g's 16..31, g+1's
// 16..31 (an odd last group as it is).
#if defined(__AVX2__)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

// One token's activations, quantized: p (groups * 32), and per group s and s * sum(p), interleaved.
struct Quantized {
  const int8_t* p;
  const float* sums;
};

// Where element i of group g goes in p.
inline int64_t position(int64_t g, int i, int64_t groups, bool pairs) {
  if (!pairs || (g == groups - 1 && groups % 2)) return g * kGroup + i;
  return (g & ~int64_t(1)) * kGroup + (i < 16 ? 0 : kGroup) + (g & 1) * 16 + i % 16;
}

template <typename T>
void quantize_row(const T* x, int64_t groups, int8_t* p, float* sums, bool pairs) {
  for (int64_t g = 0; g < groups; ++g) {
    const T* in = x + g * kGroup;
    alignas(64) float wide[kGroup];
    fvec peak(0.f);
    for (int i = 0; i < kGroup; i += W) {
      const fvec v = load(in + i);
      v.store(wide + i);
      peak = at::vec::maximum(peak, v.abs());
    }
    alignas(64) float lanes[W];
    peak.store(lanes);
    const float amax = *std::max_element(lanes, lanes + W);
    const float s = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kGroup; ++i) {
      const int q = static_cast<int>(std::nearbyint(wide[i] * inverse));
      p[position(g, i, groups, pairs)] = static_cast<int8_t>(q);
      sum += q;
    }
    sums[2 * g] = s;
    sums[2 * g + 1] = s * static_cast<float>(sum);
  }
}

#if defined(__AVX2__)
// 8 int32 sums of 4 byte products each, unsigned u times signed s (at most 4 * 255 * 127).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else  // pairs summed in int16 (at most 2 * 15 * 127 here: the 8-bit weights go in as |q|), then in fours
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

// out[t][r] = sum over groups of d * s * (q . p), for kRows weight rows and Tokens tokens: each
// weight group is loaded (and unpacked) once for all the tokens. d: a row's per-group scales,
// `stride` apart.
template <int Bits, int Tokens>
void dot_tile(const uint8_t* const* w, const c10::Half* const* d, int64_t stride, const Quantized* a, int64_t groups,
              float (*out)[kRows]) {
  constexpr int64_t bytes = Bits == 4 ? kGroup / 2 : kGroup;
#if defined(__AVX2__)
  __m256 acc[Tokens][kRows];
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i q[kRows];
    float scale[kRows];
    for (int r = 0; r < kRows; ++r) {
      if constexpr (Bits == 4) {  // byte j: q[j] low, q[j + 16] high
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + g * bytes));
        q[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
      } else {
        q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + g * bytes));
      }
      scale[r] = static_cast<float>(d[r][g * stride]);
    }
    for (int t = 0; t < Tokens; ++t) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].p + g * kGroup));
      const float s = a[t].sums[2 * g];
      for (int r = 0; r < kRows; ++r) {
        // signed 8-bit weights go in as |q|, with q's sign moved onto p
        const __m256i sums = Bits == 4 ? dot_u8s8(q[r], p) : dot_u8s8(_mm256_sign_epi8(q[r], q[r]), _mm256_sign_epi8(p, q[r]));
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale[r] * s), acc[t][r]);
      }
    }
  }
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) {
      __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[t][r]), _mm256_extractf128_ps(acc[t][r], 1));
      half = _mm_add_ps(half, _mm_movehl_ps(half, half));
      out[t][r] = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    }
#elif defined(__aarch64__)
  float32x4_t acc[Tokens][kRows];
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) acc[t][r] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    int8x16_t q0[kRows], q1[kRows];  // elements 0..15 and 16..31 of the group
    for (int r = 0; r < kRows; ++r) {
      if constexpr (Bits == 4) {  // 0..15 fits a signed byte
        const uint8x16_t b = vld1q_u8(w[r] + g * bytes);
        q0[r] = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F)));
        q1[r] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
      } else {
        q0[r] = vld1q_s8(reinterpret_cast<const int8_t*>(w[r] + g * bytes));
        q1[r] = vld1q_s8(reinterpret_cast<const int8_t*>(w[r] + g * bytes + 16));
      }
    }
    for (int t = 0; t < Tokens; ++t) {
      const int8x16_t p0 = vld1q_s8(a[t].p + g * kGroup), p1 = vld1q_s8(a[t].p + g * kGroup + 16);
      const float s = a[t].sums[2 * g];
      for (int r = 0; r < kRows; ++r) {
#if defined(__ARM_FEATURE_DOTPROD)
        const int32x4_t sums = vdotq_s32(vdotq_s32(vdupq_n_s32(0), q0[r], p0), q1[r], p1);
#else  // pairs in int16 (at most 2 * 127 * 127), then widened and added
        const int16x8_t first = vmlal_s8(vmull_s8(vget_low_s8(q0[r]), vget_low_s8(p0)), vget_high_s8(q0[r]), vget_high_s8(p0));
        const int16x8_t second = vmlal_s8(vmull_s8(vget_low_s8(q1[r]), vget_low_s8(p1)), vget_high_s8(q1[r]), vget_high_s8(p1));
        const int32x4_t sums = vpadalq_s16(vpaddlq_s16(first), second);
#endif
        acc[t][r] = vfmaq_n_f32(acc[t][r], vcvtq_f32_s32(sums), static_cast<float>(d[r][g * stride]) * s);
      }
    }
  }
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) out[t][r] = vaddvq_f32(acc[t][r]);
#else
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int sum = 0;
        for (int64_t i = 0; i < kGroup; ++i) {
          const int q = Bits == 4 ? (w[r][g * bytes + i % 16] >> (i < 16 ? 0 : 4)) & 0x0F
                                  : static_cast<int8_t>(w[r][g * bytes + i]);
          sum += q * a[t].p[g * kGroup + i];
        }
        total += static_cast<float>(d[r][g * stride]) * a[t].sums[2 * g] * static_cast<float>(sum);
      }
      out[t][r] = total;
    }
#endif
}

#if defined(__AVX2__)
// The 4-bit dot_tile on x86, offsets included: two groups a step (see kPairs), the scales and
// offsets of both widened in one instruction, the offsets summed in the same accumulator.
template <int Tokens>
void dot_tile_pairs(const uint8_t* const* w, const c10::Half* const* d, const Quantized* a, int64_t groups,
                    float (*out)[kRows]) {
  __m256 acc[Tokens][kRows];
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) acc[t][r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);  // d0 s0 to lanes 0..3, d1 s1 to 4..7
  const __m128 odd = _mm_castsi128_ps(_mm_setr_epi32(0, -1, 0, -1));
  const int64_t pairs = groups / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    __m256i lo[kRows], hi[kRows];
    __m128 dm[kRows];  // d0 m0 d1 m1
    for (int r = 0; r < kRows; ++r) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + j * kGroup));
      lo[r] = _mm256_and_si256(b, low);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
      dm[r] = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d[r] + j * 4)));
    }
    for (int t = 0; t < Tokens; ++t) {
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].p + j * 2 * kGroup));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].p + j * 2 * kGroup + kGroup));
      const __m128 sums = _mm_loadu_ps(a[t].sums + j * 4);  // s0, s0 sum(p0), s1, s1 sum(p1)
      for (int r = 0; r < kRows; ++r) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i dots = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[r], p0), hi[r], p1);
#else  // int16 pair sums of both halves (at most 4 * 15 * 127) added before widening
        const __m256i dots = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[r], p0), _mm256_maddubs_epi16(hi[r], p1)), ones);
#endif
        const __m128 scaled = _mm_mul_ps(dm[r], sums);  // d0 s0, m0 s0 sum(p0), d1 s1, m1 s1 sum(p1)
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scaled), spread), acc[t][r]);
        acc[t][r] = _mm256_add_ps(acc[t][r], _mm256_zextps128_ps256(_mm_and_ps(scaled, odd)));
      }
    }
  }
  for (int t = 0; t < Tokens; ++t)
    for (int r = 0; r < kRows; ++r) {
      __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[t][r]), _mm256_extractf128_ps(acc[t][r], 1));
      half = _mm_add_ps(half, _mm_movehl_ps(half, half));
      out[t][r] = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    }
  if (groups % 2) {  // the odd last group, as it is laid out
    const uint8_t* tail[kRows];
    const c10::Half* tail_d[kRows];
    for (int r = 0; r < kRows; ++r) tail[r] = w[r] + (groups - 1) * kGroup / 2, tail_d[r] = d[r] + (groups - 1) * 2;
    Quantized last[Tokens];
    for (int t = 0; t < Tokens; ++t) last[t] = {a[t].p + (groups - 1) * kGroup, a[t].sums + (groups - 1) * 2};
    float more[Tokens][kRows];
    dot_tile<4, Tokens>(tail, tail_d, 2, last, 1, more);
    for (int t = 0; t < Tokens; ++t)
      for (int r = 0; r < kRows; ++r) out[t][r] += more[t][r] + static_cast<float>(tail_d[r][1]) * last[t].sums[1];
  }
}
#endif

template <int Bits, int Tokens>
void dot_tile_with_offsets(const uint8_t* const* w, const c10::Half* const* d, const Quantized* a, int64_t groups,
                           float (*out)[kRows]) {
  if constexpr (Bits == 4 && kPairs) {
#if defined(__AVX2__)
    dot_tile_pairs<Tokens>(w, d, a, groups, out);
#endif
  } else {
    dot_tile<Bits, Tokens>(w, d, Bits == 4 ? 2 : 1, a, groups, out);
    if constexpr (Bits == 4)  // the offsets: sum over groups of m * s * sum(p)
      for (int t = 0; t < Tokens; ++t)
        for (int r = 0; r < kRows; ++r)
          for (int64_t g = 0; g < groups; ++g) out[t][r] += static_cast<float>(d[r][g * 2 + 1]) * a[t].sums[2 * g + 1];
  }
}

template <int Bits, typename T>
void linear_rows(const std::vector<Quantized>& xs, const uint8_t* weight, const c10::Half* scales, const float* bias, T* y,
                 int64_t rows, int64_t groups) {
  constexpr int64_t bytes = Bits == 4 ? kGroup / 2 : kGroup, stride = Bits == 4 ? 2 : 1;
  const int64_t tokens = static_cast<int64_t>(xs.size()), tiles = (rows + kRows - 1) / kRows;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 16 / tokens), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint8_t* w[kRows];
      const c10::Half* d[kRows];
      for (int r = 0; r < kRows; ++r) {  // a short last tile repeats its last row; only real rows are written
        const int64_t row = std::min(tile * kRows + r, rows - 1);
        w[r] = weight + row * groups * bytes;
        d[r] = scales + row * groups * stride;
      }
      for (int64_t t = 0; t < tokens;) {
        float out[2][kRows];
        const int n = tokens - t >= 2 ? 2 : 1;
        if (n == 2)
          dot_tile_with_offsets<Bits, 2>(w, d, xs.data() + t, groups, out);
        else
          dot_tile_with_offsets<Bits, 1>(w, d, xs.data() + t, groups, out);
        for (int i = 0; i < n; ++i, ++t)
          for (int r = 0; r < kRows && tile * kRows + r < rows; ++r) {
            const int64_t row = tile * kRows + r;
            float total = out[i][r];
            if (bias) total += bias[row];
            y[t * rows + row] = T(total);
          }
      }
    }
  });
}

// Rows [first, first + n) of a 4- or 8-bit weight widened to T, into `wide` (n, in).
template <typename T>
void widen(const uint8_t* q, const c10::Half* scales, int bits, int64_t first, int64_t inputs, at::Tensor& wide) {
  const int64_t groups = inputs / kGroup;
  T* out = wide.data_ptr<T>();
  at::parallel_for(0, wide.size(0), 16, [&](int64_t begin, int64_t end) {
    alignas(64) float values[kGroup];
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0, row = first + i; g < groups; ++g) {
        if (bits == 4) {
          const uint8_t* b = q + row * inputs / 2 + g * kGroup / 2;
          const float d = scales[(row * groups + g) * 2], m = scales[(row * groups + g) * 2 + 1];
          for (int k = 0; k < kGroup / 2; ++k) {
            values[k] = d * static_cast<float>(b[k] & 0x0F) + m;
            values[k + kGroup / 2] = d * static_cast<float>(b[k] >> 4) + m;
          }
        } else {
          const auto* b = reinterpret_cast<const int8_t*>(q) + row * inputs + g * kGroup;
          const float d = scales[row * groups + g];
          for (int k = 0; k < kGroup; ++k) values[k] = d * static_cast<float>(b[k]);
        }
        for (int k = 0; k < kGroup; k += W) store(out + i * inputs + g * kGroup + k, fvec::loadu(values + k));
      }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const std::optional<at::Tensor>& bias, int bits) {
  const int64_t tokens = x.size(0), inputs = x.size(1), rows = weight.size(0), groups = inputs / kGroup;
  if (tokens >= kGemmTokens) {
    const auto* q = reinterpret_cast<const uint8_t*>(weight.data_ptr());
    return widened_linear(x, rows, bias, [&](int64_t first, int64_t n, at::Tensor& wide) {
      widen<T>(q, scales.data_ptr<c10::Half>(), bits, first, inputs, wide);
    });
  }
  std::vector<int8_t> p(tokens * inputs);
  std::vector<float> sums(tokens * groups * 2);
  const T* in = x.data_ptr<T>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      quantize_row(in + t * x.stride(0), groups, p.data() + t * inputs, sums.data() + t * groups * 2, bits == 4 && kPairs);
  });
  std::vector<Quantized> xs;
  for (int64_t t = 0; t < tokens; ++t) xs.push_back({p.data() + t * inputs, sums.data() + t * groups * 2});
  auto y = at::empty({tokens, rows}, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const auto* w = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  if (bits == 4)
    linear_rows<4, T>(xs, w, scales.data_ptr<c10::Half>(), b, y.data_ptr<T>(), rows, groups);
  else
    linear_rows<8, T>(xs, w, scales.data_ptr<c10::Half>(), b, y.data_ptr<T>(), rows, groups);
  return y;
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kGroup == 0, "x (T, in), in a multiple of 32, a unit stride");
  const int64_t rows = weight.size(0), groups = x.size(1) / kGroup;
  const int bits = weight.size(1) * 2 == x.size(1) ? 4 : 8;
  TORCH_CHECK(weight.is_contiguous() && weight.element_size() == 1 && (bits == 4 || weight.size(1) == x.size(1)),
              "weight (out, in / 2) 4-bit or (out, in) 8-bit bytes");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.sizes() == at::IntArrayRef({rows, groups, bits == 4 ? 2 : 1}),
              "scales (out, in / 32, 2) fp16 for 4 bits: d, m; (out, in / 32, 1) for 8 bits");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == rows), "bias (out,) fp32");
  if (x.size(0) >= kGemmTokens && x.scalar_type() != at::kFloat && !onednn_runs(x.scalar_type()))  // the GEMM in fp32
    return quantized_linear(x.to(at::kFloat), weight, scales, bias).to(x.scalar_type());
  if (x.scalar_type() == at::kBFloat16) return run<c10::BFloat16>(x, weight, scales, bias, bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fp32 or bf16");
  return run<float>(x, weight, scales, bias, bits);
}

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("quantized_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("quantized_linear", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::quantized_linear);
}
