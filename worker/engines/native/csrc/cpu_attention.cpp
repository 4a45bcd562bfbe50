// Decode attention on CPUs, straight from the paged KV cache (kernels.py compiles this on first use).
//
// One new token per sequence; caches (slots, kv_heads, D), slot = block * block_size + offset. The
// query heads that share a KV head walk its blocks together, so each K and V row is read once for
// all of them, in fp32 for fp32 and bf16 caches alike. In torch the same step gathered each context
// into a contiguous copy (index_select), upcast it from bf16 and ran SDPA: on the 2-core machine,
// batch 8 and ~200-token contexts of SmolLM2, ~300 us a layer against ~80 here.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace cyllm {
namespace {

#ifdef __AVX512F__
// 16 vectors -> one vector of their 16 sums (lane i: the sum of s[i]'s lanes), in 15 adds.
inline __m512 sum16x16(__m512* s) {
  for (int i = 0; i < 8; ++i)  // lane k of 128 bits: halves of s[2i]'s and s[2i+1]'s lane-k sums
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane k: the lane-k sums of 4 vectors
    __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0, 1 and 2, 3: two lanes' sums of 4 vectors each
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88), _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88), _mm512_shuffle_f32x4(s[0], s[1], 0xdd));
}

// A row into the caches: Locality 3 into L1 (needed next), 2 into L2 (needed after the softmax).
template <int Locality, typename T, int V>
inline void prefetch(const T* row) {
  for (int byte = 0; byte < 16 * V * (int)sizeof(T); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, Locality);
}

// G query heads of one KV head over their n context tokens, D = 16 * V. q (G, D) scaled; scores
// (G, n) scratch; out (G, D). Rows come from scattered blocks: prefetching two tiles of K ahead
// (and each tile's V for later) took a layer of SmolLM2 at batch 8 from ~110 to ~80 us.
template <typename T, int V, int G>
void heads16(const float* q, const T* const* rows_k, const T* const* rows_v, int64_t n, float* scores, float* out) {
  alignas(64) float tile[16][16 * V];
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - t0);
    for (int64_t i = t0 + 32; i < std::min(n, t0 + 48); ++i) prefetch<3, T, V>(rows_k[i]);
    for (int64_t i = t0; i < t0 + m; ++i) prefetch<2, T, V>(rows_v[i]);
    for (int64_t i = 0; i < 16; ++i)
      for (int j = 0; j < V; ++j) _mm512_store_ps(tile[i] + 16 * j, i < m ? load16(rows_k[t0 + i] + 16 * j) : _mm512_setzero_ps());
    for (int g = 0; g < G; ++g) {
      __m512 s[16];
      for (int i = 0; i < 16; ++i) {
        s[i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * 16 * V), _mm512_load_ps(tile[i]));
        for (int j = 1; j < V; ++j)
          s[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * 16 * V + 16 * j), _mm512_load_ps(tile[i] + 16 * j), s[i]);
      }
      _mm512_mask_storeu_ps(scores + g * n + t0, (__mmask16)((1u << m) - 1), sum16x16(s));
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {  // softmax numerators in place, and 1 / their sum
    float* row = scores + g * n;
    float top = -INFINITY;
    for (int64_t t = 0; t < n; ++t) top = std::max(top, row[t]);
    __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(top);
    for (int64_t t = 0; t < n; t += 16) {
      __mmask16 live = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
      __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), mv)));
      _mm512_mask_storeu_ps(row + t, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    if (t + 16 < n) prefetch<3, T, V>(rows_v[t + 16]);
    __m512 v[V];
    for (int j = 0; j < V; ++j) v[j] = load16(rows_v[t] + 16 * j);
    for (int g = 0; g < G; ++g) {
      __m512 p = _mm512_set1_ps(scores[g * n + t]);
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(out + g * 16 * V + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
}

// Up to 4 heads at D = 64 and 2 at D = 128: G * V accumulators stay within 16 of the 32 registers.
template <typename T>
bool heads_simd(int64_t g, int64_t dim, const float* q, const T* const* k, const T* const* v, int64_t n, float* s, float* o) {
  if (dim == 64 && g == 1) heads16<T, 4, 1>(q, k, v, n, s, o);
  else if (dim == 64 && g == 2) heads16<T, 4, 2>(q, k, v, n, s, o);
  else if (dim == 64 && g == 3) heads16<T, 4, 3>(q, k, v, n, s, o);
  else if (dim == 64 && g == 4) heads16<T, 4, 4>(q, k, v, n, s, o);
  else if (dim == 128 && g == 1) heads16<T, 8, 1>(q, k, v, n, s, o);
  else if (dim == 128 && g == 2) heads16<T, 8, 2>(q, k, v, n, s, o);
  else return false;
  return true;
}
#endif

// Any D, one head at a time in plain loops: machines without AVX-512 and other head sizes.
template <typename T>
void heads_any(int64_t g, int64_t dim, const float* q, const T* const* rows_k, const T* const* rows_v, int64_t n,
               float* scores, float* out) {
  for (int64_t h = 0; h < g; ++h, q += dim, out += dim) {
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
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, const int32_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads, stride = kv_heads * dim;
  const int64_t most = dim == 128 ? 2 : 4, parts = (group + most - 1) / most;  // work items: (sequence, KV head, part)
  at::parallel_for(0, batch * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(most * dim), of(most * dim), scores;
    std::vector<const T*> rows_k, rows_v;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * parts), kv = item / parts % kv_heads, part = item % parts, n = lens[b];
      const int64_t first_head = kv * group + part * most, g = std::min(most, group - part * most);
      T* o = out + (b * heads + first_head) * dim;
      if (n <= 0) {  // a padding row
        std::fill(o, o + g * dim, T(0));
        continue;
      }
      rows_k.resize(n);
      rows_v.resize(n);
      scores.resize(g * n);
      for (int64_t t = 0; t < n; t += block_size) {  // slot = block * block_size + offset
        const int64_t first = (int64_t)tables[b * width + t / block_size] * block_size * stride + kv * dim;
        for (int64_t i = 0; i < std::min(block_size, n - t); ++i) {
          rows_k[t + i] = k_cache + first + i * stride;
          rows_v[t + i] = v_cache + first + i * stride;
        }
      }
      const T* qh = q + (b * heads + first_head) * dim;
      for (int64_t d = 0; d < g * dim; ++d) qf[d] = static_cast<float>(qh[d]) * scale;
#ifdef __AVX512F__
      if (!heads_simd<T>(g, dim, qf.data(), rows_k.data(), rows_v.data(), n, scores.data(), of.data()))
#endif
        heads_any<T>(g, dim, qf.data(), rows_k.data(), rows_v.data(), n, scores.data(), of.data());
      for (int64_t d = 0; d < g * dim; ++d) o[d] = T(of[d]);
    }
  });
}

}  // namespace

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
    using T = c10::BFloat16;
    decode<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), table, len, out.data_ptr<T>(), batch, heads,
              kv_heads, dim, width, block_size, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 or bf16");
    decode<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, len,
                  out.data_ptr<float>(), batch, heads, kv_heads, dim, width, block_size, static_cast<float>(scale));
  }
  return out;
}

}  // namespace cyllm

TORCH_LIBRARY(cyllm, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, int block_size, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &cyllm::paged_decode);
}
