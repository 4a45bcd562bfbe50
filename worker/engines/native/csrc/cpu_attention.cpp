// Decode attention on CPUs, straight from the paged KV cache (kernels.py compiles this on first use).
//
// One new token per sequence; caches (slots, kv_heads, D), slot = block * block_size + offset; every
// query head walks its sequence's blocks in place, in fp32 for fp32 and bf16 caches alike. In torch
// the same step gathered each context into a contiguous copy (index_select), upcast it from bf16 and
// ran SDPA: on the 2-core machine, batch 8 and ~200-token contexts of SmolLM2, ~300 us a layer
// against ~50 here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0 (scores less their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6
// Taylor polynomial (relative error ~2e-7, an ulp or two).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One query head over its n context tokens; D = 16 * V.
template <typename T, int V>
void head16(const float* q, const T* const* rows_k, const T* const* rows_v, int64_t n, float* scores, float* out) {
  __m512 qv[V], acc[V];
  for (int j = 0; j < V; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; ++t) {
    __m512 s = _mm512_mul_ps(qv[0], load16(rows_k[t]));
    for (int j = 1; j < V; ++j) s = _mm512_fmadd_ps(qv[j], load16(rows_k[t] + 16 * j), s);
    scores[t] = _mm512_reduce_add_ps(s);
  }
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) m = std::max(m, scores[t]);
  __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t), mv));
    _mm512_storeu_ps(scores + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {
    __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + t), mv));
    _mm512_mask_storeu_ps(scores + t, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  for (int j = 0; j < V; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 p = _mm512_set1_ps(scores[t]);
    for (int j = 0; j < V; ++j) acc[j] = _mm512_fmadd_ps(p, load16(rows_v[t] + 16 * j), acc[j]);
  }
  __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int j = 0; j < V; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}
#endif

// Any D, plain loops: machines without AVX-512 and odd head sizes.
template <typename T>
void head_any(const float* q, const T* const* rows_k, const T* const* rows_v, int64_t n, int64_t dim, float* scores,
              float* out) {
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    float s = 0.f;
    for (int64_t d = 0; d < dim; ++d) s += q[d] * static_cast<float>(rows_k[t][d]);
    scores[t] = s;
    m = std::max(m, s);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += scores[t] = std::exp(scores[t] - m);
  std::fill(out, out + dim, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < dim; ++d) out[d] += scores[t] * static_cast<float>(rows_v[t][d]);
  for (int64_t d = 0; d < dim; ++d) out[d] /= sum;
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, const int32_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads, stride = kv_heads * dim;
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(dim), of(dim), scores;
    std::vector<const T*> rows_k, rows_v;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads, n = lens[b];
      T* o = out + item * dim;
      if (n <= 0) {  // a padding row
        std::fill(o, o + dim, T(0));
        continue;
      }
      const int64_t column = (h / group) * dim;
      rows_k.resize(n);
      rows_v.resize(n);
      scores.resize(n);
      for (int64_t t = 0; t < n; t += block_size) {  // slot = block * block_size + offset
        const int64_t first = (int64_t)tables[b * width + t / block_size] * block_size * stride + column;
        for (int64_t i = 0; i < std::min(block_size, n - t); ++i) {
          rows_k[t + i] = k_cache + first + i * stride;
          rows_v[t + i] = v_cache + first + i * stride;
        }
      }
      for (int64_t d = 0; d < dim; ++d) qf[d] = static_cast<float>(q[item * dim + d]) * scale;
#ifdef __AVX512F__
      if (dim == 64)
        head16<T, 4>(qf.data(), rows_k.data(), rows_v.data(), n, scores.data(), of.data());
      else if (dim == 128)
        head16<T, 8>(qf.data(), rows_k.data(), rows_v.data(), n, scores.data(), of.data());
      else
#endif
        head_any<T>(qf.data(), rows_k.data(), rows_v.data(), n, dim, scores.data(), of.data());
      for (int64_t d = 0; d < dim; ++d) o[d] = T(of[d]);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "q (B, H, D), caches (slots, kv_heads, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt, "tables and lens in int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(2) == k_cache.size(2), "heads a multiple of kv_heads, one head size");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1), width = tables.size(1);
  TORCH_CHECK(tables.size(0) == batch && lens.numel() == batch, "a table and a length per sequence");
  // Every block read must be in the cache: checked here, where an error can still be raised.
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] <= width * block_size, "a context longer than its block table");
    for (int64_t j = 0; j * block_size < len[b]; ++j)
      TORCH_CHECK(table[b * width + j] >= 0 && table[b * width + j] < num_blocks, "a block outside the cache");
  }
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                          tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<c10::BFloat16>(), batch,
                          heads, kv_heads, dim, width, block_size, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 or bf16");
    decode<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(),
                  lens.data_ptr<int32_t>(), out.data_ptr<float>(), batch, heads, kv_heads, dim, width, block_size,
                  static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(cyllm, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, int block_size, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
