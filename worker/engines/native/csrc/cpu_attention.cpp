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
#include <numeric>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace cyllm::CYLLM_OPS {
namespace {

// A row into the caches: Locality 3 into L1 (needed next), 2 into L2 (needed after the softmax).
template <int Locality, typename T, int V>
inline void prefetch(const T* row) {
  for (int byte = 0; byte < W * V * (int)sizeof(T); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, Locality);
}

// G query heads of one KV head over their n context tokens, D = W * V, W tokens a tile. q (G, D)
// scaled; scores (G, n) scratch; out (G, D). Rows come from scattered blocks: prefetching two tiles
// of K ahead (and each tile's V for later) took a layer of SmolLM2 at batch 8 from ~110 to ~80 us
// on AVX-512.
template <typename T, int V, int G>
void heads_tiled(const float* q, const T* const* rows_k, const T* const* rows_v, int64_t n, float* scores, float* out) {
  alignas(64) float tile[W][W * V];
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    const int64_t m = std::min<int64_t>(W, n - t0);
    for (int64_t i = t0 + 2 * W; i < std::min(n, t0 + 3 * W); ++i) prefetch<3, T, V>(rows_k[i]);
    for (int64_t i = t0; i < t0 + m; ++i) prefetch<2, T, V>(rows_v[i]);
    for (int64_t i = 0; i < W; ++i)
      for (int j = 0; j < V; ++j) (i < m ? load(rows_k[t0 + i] + W * j) : fvec(0.f)).store(tile[i] + W * j);
    for (int g = 0; g < G; ++g) {
      fvec s[W];
      for (int i = 0; i < W; ++i) {
        s[i] = fvec::loadu(q + g * W * V) * fvec::loadu(tile[i]);
        for (int j = 1; j < V; ++j) s[i] = at::vec::fmadd(fvec::loadu(q + g * W * V + W * j), fvec::loadu(tile[i] + W * j), s[i]);
      }
      sum_lanes(s).store(scores + g * n + t0, m);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {  // softmax numerators in place, and 1 / their sum
    float* row = scores + g * n;
    float top = -INFINITY;
    for (int64_t t = 0; t < n; ++t) top = std::max(top, row[t]);
    fvec sum(0.f);
    const fvec most(top);
    for (int64_t t = 0; t < n; t += W) {
      const int64_t live = std::min<int64_t>(W, n - t);
      const fvec e = fvec::set(fvec(0.f), vexp(fvec::loadu(row + t, live) - most), live);
      e.store(row + t, live);
      sum = sum + e;
    }
    alignas(64) float lanes[W];
    sum.store(lanes);
    inv[g] = 1.f / std::accumulate(lanes, lanes + W, 0.f);
  }
  fvec acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = fvec(0.f);
  for (int64_t t = 0; t < n; ++t) {
    if (t + W < n) prefetch<3, T, V>(rows_v[t + W]);
    fvec v[V];
    for (int j = 0; j < V; ++j) v[j] = load(rows_v[t] + W * j);
    for (int g = 0; g < G; ++g) {
      const fvec p(scores[g * n + t]);
      for (int j = 0; j < V; ++j) acc[g][j] = at::vec::fmadd(p, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) (acc[g][j] * fvec(inv[g])).store(out + g * W * V + W * j);
}

// Query heads walked together per KV head: as many as keep their G * V accumulators within half
// the vector registers (1 to 4), so D = 64 takes 4 heads on AVX-512, 1 on AVX2 and NEON.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t REGISTERS = 16;
#else
constexpr int64_t REGISTERS = 32;
#endif
inline int64_t heads_per_item(int64_t dim) {
  return dim == 64 || dim == 128 ? std::clamp<int64_t>(REGISTERS / 2 / (dim / W), 1, 4) : 4;
}

template <typename T, int V>
void heads_g(int64_t g, const float* q, const T* const* k, const T* const* v, int64_t n, float* s, float* o) {
  switch (g) {
    case 1: return heads_tiled<T, V, 1>(q, k, v, n, s, o);
    case 2: return heads_tiled<T, V, 2>(q, k, v, n, s, o);
    case 3: return heads_tiled<T, V, 3>(q, k, v, n, s, o);
    default: return heads_tiled<T, V, 4>(q, k, v, n, s, o);
  }
}

// The tiled kernel for D = 64 and 128 (g <= heads_per_item(D)); false: run heads_any.
template <typename T>
bool heads_simd(int64_t g, int64_t dim, const float* q, const T* const* k, const T* const* v, int64_t n, float* s, float* o) {
  if (dim == 64) heads_g<T, 64 / W>(g, q, k, v, n, s, o);
  else if (dim == 128) heads_g<T, 128 / W>(g, q, k, v, n, s, o);
  else return false;
  return true;
}

// Any D, one head at a time in plain loops: the head sizes the tiled kernel has no instance for.
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
  const int64_t most = heads_per_item(dim), parts = (group + most - 1) / most;  // work items: (sequence, KV head, part)
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
      if (!heads_simd<T>(g, dim, qf.data(), rows_k.data(), rows_v.data(), n, scores.data(), of.data()))
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

}  // namespace cyllm::CYLLM_OPS

TORCH_LIBRARY_FRAGMENT(CYLLM_OPS, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, int block_size, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &cyllm::CYLLM_OPS::paged_decode);
}
