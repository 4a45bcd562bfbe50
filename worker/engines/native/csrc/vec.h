// The vector the kernels are written over: ATen's Vectorized<float>, W lanes of the instruction set
// this library is compiled for (kernels.py builds one library per ISA, defining CPU_CAPABILITY):
// 16 on AVX-512, 8 on AVX2, 4 on NEON, 8 plain floats in the DEFAULT build. ATen has no load from
// 8 / 16 bf16 into one float vector, no bf16 store of one, and no lane-sum of W vectors: those few
// lines are written per ISA here, everything else in the kernels is the same source for all.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstring>

#include "ops.h"

namespace cyllm::CYLLM_OPS {

using fvec = at::vec::Vectorized<float>;
constexpr int W = fvec::size();

inline fvec load(const float* p) { return fvec::loadu(p); }

inline fvec load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
#if defined(CPU_CAPABILITY_AVX512)
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#elif defined(__aarch64__)
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
#else
  alignas(64) float wide[W];
  for (int i = 0; i < W; ++i) wide[i] = static_cast<float>(p[i]);
  return fvec::loadu(wide);
#endif
}

inline void store(float* p, fvec x) { x.store(p); }

// Rounded to nearest even, NaN kept a NaN, as c10's cast: bits + 0x7fff + (bit 16), the top half.
inline void store(c10::BFloat16* p, fvec x) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512i bits = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i bits = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // packus narrows each 128-bit half; the permute brings the two halves' four words together.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#elif defined(__aarch64__)
  uint32x4_t bits = vreinterpretq_u32_f32(x);
  uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
  rounded = vbslq_u32(vceqq_f32(x, x), rounded, vdupq_n_u32(0x7fc0));
  vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(rounded));
#else
  alignas(64) float wide[W];
  x.store(wide);
  for (int i = 0; i < W; ++i) p[i] = c10::BFloat16(wide[i]);
#endif
}

// W vectors -> one vector of their W sums (lane i: the sum of s[i]'s lanes), in W - 1 adds.
inline fvec sum_lanes(fvec* s) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = s[i];
  for (int i = 0; i < 8; ++i)  // lane k of 128 bits: halves of v[2i]'s and v[2i+1]'s lane-k sums
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane k: the lane-k sums of 4 vectors
    __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0, 1 and 2, 3: two lanes' sums of 4 vectors each
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xdd));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = s[i];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);  // pair sums, per 128-bit half
  v[0] = _mm256_hadd_ps(v[0], v[1]);  // per half: the half-sums of s[0..3]
  v[1] = _mm256_hadd_ps(v[2], v[3]);  // and of s[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
#elif defined(__aarch64__)
  float32x4_t low = vpaddq_f32(s[0], s[1]), high = vpaddq_f32(s[2], s[3]);
  return vpaddq_f32(low, high);
#else
  alignas(64) float lanes[W], sums[W];
  for (int i = 0; i < W; ++i) {
    s[i].store(lanes);
    sums[i] = 0.f;
    for (int j = 0; j < W; ++j) sums[i] += lanes[j];
  }
  return fvec::loadu(sums);
#endif
}

// e^x: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6 Taylor polynomial (relative error
// ~2e-7, an ulp or two); 0 below -87, inf above ln(FLT_MAX). 2^n is built in two halves, each a
// normal float, so that p * 2^n is rounded once, as AVX-512's scalef does it.
inline fvec vexp(fvec x) {
  const fvec top(88.7228394f);
  const fvec over = x > top;
  x = at::vec::clamp(x, fvec(-87.f), top);
  const fvec n = (x * fvec(1.44269504f)).round();
  fvec r = at::vec::fmadd(n, fvec(-0.693145752f), x);
  r = at::vec::fmadd(n, fvec(-1.42860677e-6f), r);
  fvec p(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = at::vec::fmadd(p, r, fvec(c));
  using ivec = at::vec::Vectorized<int32_t>;
  const ivec whole = at::vec::convert_to_int_of_same_size(n), half = whole >> ivec(1), bias(127), mantissa(23);
  p = p * at::vec::cast<float>((half + bias) << mantissa) * at::vec::cast<float>((whole - half + bias) << mantissa);
  return fvec::blendv(p, fvec(INFINITY), over);
}

}  // namespace cyllm::CYLLM_OPS
