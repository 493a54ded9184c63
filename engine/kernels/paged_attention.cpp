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

// Cache rows are scattered over the cache's slots, so the hardware prefetcher does not see them
// coming: ask for a row a few keys ahead (a hint; it never faults, whatever the address).
template <int N>
__attribute__((always_inline)) inline void prefetch_row(const float* row) {
  for (int c = 0; c < N; ++c) __builtin_prefetch(row + 16 * c);
}

// Lane i of the result = the sum of v[i]'s 16 lanes: sixteen dot products finished together
// by halving pairs (30 two-source shuffles and 15 adds), instead of folding each on its own.
__attribute__((always_inline)) inline Lanes16 sum_each(Lanes16 v[16]) {
  Lanes16 u[8], w[4], x[2];
  for (int k = 0; k < 8; ++k)  // lanes 0-7 fold v[2k], lanes 8-15 fold v[2k+1]
    u[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // each run of 4 lanes folds one of v[4k .. 4k+3]
    w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * k], u[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // each pair of lanes folds one of v[8k .. 8k+7]
    x[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(w[2 * k], w[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// scores[h L + l] = scale * q[h] . k[l] for the group's query heads h and keys l (D = 16 N),
// sixteen keys at a time, every head before the next sixteen keys, so each key row comes from
// memory once. A key the mask hides scores -inf and is never read (its slot may hold anything).
template <int N>
__attribute__((always_inline)) inline void score_keys(const float* q, int64_t group,
                                                      const float* k_cache, const int64_t* slots,
                                                      const bool* visible, int64_t kv_heads,
                                                      int64_t kvh, int64_t L, float scale,
                                                      float* scores) {
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - l0);
    for (int64_t i = l0 + 16; i < std::min<int64_t>(L, l0 + 32); ++i)
      prefetch_row<N>(k_cache + (slots[i] * kv_heads + kvh) * 16 * N);
    for (int64_t h = 0; h < group; ++h) {
      Lanes16 qv[N];
      for (int c = 0; c < N; ++c) std::memcpy(&qv[c], q + h * 16 * N + 16 * c, sizeof qv[c]);
      Lanes16 part[16];
      for (int64_t i = 0; i < 16; ++i) {
        part[i] = Lanes16{};
        if (i >= n || (visible && !visible[l0 + i])) continue;
        const float* kr = k_cache + (slots[l0 + i] * kv_heads + kvh) * 16 * N;
        for (int c = 0; c < N; ++c) {
          Lanes16 k;
          std::memcpy(&k, kr + 16 * c, sizeof k);
          part[i] += qv[c] * k;
        }
      }
      const Lanes16 s = sum_each(part) * scale;
      for (int64_t i = 0; i < n; ++i)
        scores[h * L + l0 + i] =
            visible && !visible[l0 + i] ? -std::numeric_limits<float>::infinity() : s[i];
    }
  }
}

// p[0 .. L) = softmax(p) in place; exactly 0 where p was -inf.
__attribute__((always_inline)) inline void softmax_in_place(float* p, int64_t L) {
  // Reductions in explicit lanes: a plain float loop's max and sum stay scalar (their order
  // is fixed without -ffast-math), and the exp loop with them.
  Lanes16 top;
  for (int i = 0; i < 16; ++i) top[i] = -std::numeric_limits<float>::infinity();
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) {
    Lanes16 s;
    std::memcpy(&s, p + l, sizeof s);
    top = top > s ? top : s;
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < 16; ++i) best = std::max(best, top[i]);
  for (; l < L; ++l) best = std::max(best, p[l]);
  for (l = 0; l < L; ++l) p[l] = specserve_kernels::vector_exp(p[l] - best);
  Lanes16 sum = {};
  for (l = 0; l + 16 <= L; l += 16) {
    Lanes16 s;
    std::memcpy(&s, p + l, sizeof s);
    sum += s;
  }
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += sum[i];
  for (; l < L; ++l) total += p[l];
  const float inv = 1.f / total;
  for (l = 0; l < L; ++l) p[l] *= inv;
}

// out[h] = sum over visible keys l of p[h][l] * v[l] for G heads at once (D = 16 N), the sums
// held in registers; each value row is read once for all G heads.
template <int N, int G>
__attribute__((always_inline)) inline void weigh_values(const float* p, const float* v_cache,
                                                        const int64_t* slots, const bool* visible,
                                                        int64_t kv_heads, int64_t kvh, int64_t L,
                                                        float* out) {
  Lanes16 acc[G][N] = {};
  for (int64_t l = 0; l < L; ++l) {
    if (l + 16 < L) prefetch_row<N>(v_cache + (slots[l + 16] * kv_heads + kvh) * 16 * N);
    if (visible && !visible[l]) continue;  // never read: its slot may hold anything
    const float* vr = v_cache + (slots[l] * kv_heads + kvh) * 16 * N;
    for (int i = 0; i < N; ++i) {
      // One vector at a time, never the array's address: GCC then keeps the sums in registers
      // (with a memcpy of the whole array it kept them on the stack, one store per FMA).
      Lanes16 v;
      std::memcpy(&v, vr + 16 * i, sizeof v);
      for (int h = 0; h < G; ++h) acc[h][i] += p[h * L + l] * v;
    }
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < N; ++i) {
      const Lanes16 a = acc[h][i];
      std::memcpy(out + h * 16 * N + 16 * i, &a, sizeof a);
    }
}

// Value sums for `group` heads, G of them per pass (G N registers of sums).
template <int N, int G>
__attribute__((always_inline)) inline void weigh_values_grouped(const float* p, const float* v_cache, const int64_t* slots,
                                 const bool* visible, int64_t kv_heads, int64_t kvh, int64_t L,
                                 int64_t group, float* out) {
  int64_t h = 0;
  for (; h + G <= group; h += G)
    weigh_values<N, G>(p + h * L, v_cache, slots, visible, kv_heads, kvh, L, out + h * 16 * N);
  for (; h < group; ++h)
    weigh_values<N, 1>(p + h * L, v_cache, slots, visible, kv_heads, kvh, L, out + h * 16 * N);
}

// One sequence (group member) and one KV head: every query row of the member, for every query
// head sharing that KV head, attends to its visible keys. Cloned for AVX-512, AVX2 and
// baseline; the loader picks at run time. Head sizes of 64 and 128 take the vector paths.
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
    if (D == 64) {
      score_keys<4>(qr, group, k_cache, slots, visible, g.kv_heads, kvh, L, scale, scores);
    } else if (D == 128) {
      score_keys<8>(qr, group, k_cache, slots, visible, g.kv_heads, kvh, L, scale, scores);
    } else {
      for (int64_t h = 0; h < group; ++h)
        for (int64_t l = 0; l < L; ++l) {
          const float* kr = k_cache + (slots[l] * g.kv_heads + kvh) * D;
          scores[h * L + l] = visible && !visible[l] ? -std::numeric_limits<float>::infinity()
                                                     : dot(qr + h * D, kr, D) * scale;
        }
    }
    for (int64_t h = 0; h < group; ++h) softmax_in_place(scores + h * L, L);
    if (D == 64) {
      weigh_values_grouped<4, 4>(scores, v_cache, slots, visible, g.kv_heads, kvh, L, group, o);
    } else if (D == 128) {
      weigh_values_grouped<8, 2>(scores, v_cache, slots, visible, g.kv_heads, kvh, L, group, o);
    } else {
      std::fill(o, o + group * D, 0.f);
      for (int64_t h = 0; h < group; ++h) {
        const float* p = scores + h * L;
        float* oh = o + h * D;
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
