// Attention of short query runs (decode tokens, draft tokens to verify) over the paged KV
// cache, reading each key and value straight from its cache slot. The PyTorch path in
// engine/attention.py gathers every sequence's keys into a padded copy first and then runs
// SDPA; for a few queries per sequence that copy and the dispatch around it cost more than the
// attention itself. Float32, CPU; results equal SDPA's up to summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "vector_exp.h"

namespace {

struct Geometry {
  int64_t heads, kv_heads, dim, keys, queries;
};

// q . k in GCC vector types: 16 lanes of partial sums (one AVX-512 register, two AVX2 ones in
// that clone), folded in halves. Written as plain float loops this compiled to a scalar fold
// that cost more than the products. Inlined into each clone below.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));

inline float dot(const float* a, const float* b, int64_t n) {
  Lanes16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    Lanes16 x, y;
    std::memcpy(&x, a + d, sizeof x);
    std::memcpy(&y, b + d, sizeof y);
    acc += x * y;
  }
  const Lanes8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const Lanes4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  float s = (h4[0] + h4[2]) + (h4[1] + h4[3]);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// out[0 .. 16 * N) = sum over visible keys l of p[l] * v[l], the sum held in registers.
template <int N>
__attribute__((always_inline)) inline void weigh_values(const float* p, const float* v_cache,
                                                        const int64_t* slots, const bool* visible,
                                                        int64_t kv_heads, int64_t kvh, int64_t L,
                                                        float* out) {
  Lanes16 acc[N] = {};
  for (int64_t l = 0; l < L; ++l) {
    if (visible && !visible[l]) continue;  // never read: its slot may hold anything
    const float* vr = v_cache + (slots[l] * kv_heads + kvh) * 16 * N;
    for (int i = 0; i < N; ++i) {
      Lanes16 v;
      std::memcpy(&v, vr + 16 * i, sizeof v);
      acc[i] += p[l] * v;
    }
  }
  std::memcpy(out, acc, sizeof acc);
}

// One sequence (group member) and one KV head: every query row of the member, for every query
// head sharing that KV head, attends to its visible keys. Each key and value row is read once
// for all those heads. Cloned for AVX-512, AVX2 and baseline; the loader picks at run time.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_member_kv_head(const float* q, const float* k_cache, const float* v_cache,
                           const int64_t* rows, const int64_t* slots, const bool* mask,
                           const bool* valid, Geometry g, int64_t kvh, float scale, float* out,
                           float* scores) {
  const int64_t D = g.dim, group = g.heads / g.kv_heads, L = g.keys;
  for (int64_t j = 0; j < g.queries; ++j) {
    if (valid && !valid[j]) continue;
    const bool* visible = mask ? mask + j * L : nullptr;
    const float* qr = q + (rows[j] * g.heads + kvh * group) * D;  // the group's heads, adjacent
    float* o = out + (rows[j] * g.heads + kvh * group) * D;
    for (int64_t l = 0; l < L; ++l) {
      const float* kr = k_cache + (slots[l] * g.kv_heads + kvh) * D;
      for (int64_t h = 0; h < group; ++h)
        scores[h * L + l] = visible && !visible[l] ? -std::numeric_limits<float>::infinity()
                                                   : dot(qr + h * D, kr, D) * scale;
    }
    for (int64_t h = 0; h < group; ++h) {
      float* s = scores + h * L;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < L; ++l) best = std::max(best, s[l]);
      float total = 0.f;
      for (int64_t l = 0; l < L; ++l) {
        s[l] = specserve_kernels::vector_exp(s[l] - best);  // exactly 0 for a masked key
        total += s[l];
      }
      const float inv = 1.f / total;
      for (int64_t l = 0; l < L; ++l) s[l] *= inv;
      std::fill(o + h * D, o + (h + 1) * D, 0.f);
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* p = scores + h * L;
      float* oh = o + h * D;
      if (D == 64) {
        weigh_values<4>(p, v_cache, slots, visible, g.kv_heads, kvh, L, oh);
      } else if (D == 128) {
        weigh_values<8>(p, v_cache, slots, visible, g.kv_heads, kvh, L, oh);
      } else {
        for (int64_t l = 0; l < L; ++l) {
          if (visible && !visible[l]) continue;  // never read: its slot may hold anything
          const float* vr = v_cache + (slots[l] * g.kv_heads + kvh) * D;
          for (int64_t d = 0; d < D; ++d) oh[d] += p[l] * vr[d];
        }
      }
    }
  }
}

// q [T, H, D]; caches [slots, KVH, D]; query_index [b, qn] rows of q (padding repeats a row);
// kv_slots [b, L]; mask [b, 1, qn, L] (None: all visible); valid [b * qn] (None: all real).
// Writes out[row] for every real query row.
void cached_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& query_index, const at::Tensor& kv_slots,
                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& valid,
                      double scale, at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(query_index.is_contiguous() && kv_slots.is_contiguous(), "index tensors");
  const Geometry g{q.size(1), k_cache.size(1), q.size(2), kv_slots.size(1), query_index.size(1)};
  TORCH_CHECK(g.heads % g.kv_heads == 0 && k_cache.size(2) == g.dim, "head shapes");
  const int64_t members = query_index.size(0);
  // Contiguous copies live as long as the call (a pointer into a temporary would dangle).
  const at::Tensor mask_c = mask && mask->defined() ? mask->contiguous() : at::Tensor();
  const at::Tensor valid_c = valid && valid->defined() ? valid->contiguous() : at::Tensor();
  const bool* m = mask_c.defined() ? mask_c.data_ptr<bool>() : nullptr;
  const bool* ok = valid_c.defined() ? valid_c.data_ptr<bool>() : nullptr;
  const int64_t* rows = query_index.data_ptr<int64_t>();
  const int64_t* slots = kv_slots.data_ptr<int64_t>();
  // Indices are read unchecked below; refuse any that would leave the tensors (a plain loop:
  // cheaper than reduction ops for the few hundred indices of a step).
  for (int64_t i = 0; i < query_index.numel(); ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < q.size(0), "query row ", rows[i], " out of range");
  for (int64_t i = 0; i < kv_slots.numel(); ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < k_cache.size(0), "cache slot ", slots[i], " out of range");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat &&
                  out.sizes() == q.sizes(), "cache or output shape mismatch");
  at::parallel_for(0, members * g.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g.heads / g.kv_heads * g.keys);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / g.kv_heads, kvh = t % g.kv_heads;
      attend_member_kv_head(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), rows + i * g.queries, slots + i * g.keys,
                            m ? m + i * g.queries * g.keys : nullptr,
                            ok ? ok + i * g.queries : nullptr, g, kvh, float(scale),
                            out.data_ptr<float>(), scores.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def(
      "cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_index, "
      "Tensor kv_slots, Tensor? mask, Tensor? valid, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("cached_attention", cached_attention); }
