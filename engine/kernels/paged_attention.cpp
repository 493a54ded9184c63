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
#include <utility>
#include <vector>

#include "vector_exp.h"

namespace {

struct Geometry {
  int64_t heads, kv_heads, dim, keys, queries;
};

// Vectors in GCC vector types, W lanes wide: 16 (one AVX-512 register) in the AVX-512 build of
// the kernel, 8 (one AVX2 register) in the others. Each build must use its own register width:
// 16-lane vectors compiled for AVX2 became pairs of halves moved through the stack, a scalar
// broadcast became sixteen stores, and attention ran 5-7x slower than it does with 8 lanes.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));

template <typename V>
constexpr int lanes() {
  return sizeof(V) / sizeof(float);
}

template <typename V>
__attribute__((always_inline)) inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
__attribute__((always_inline)) inline V splat(float x) {
  V v;
  for (int i = 0; i < lanes<V>(); ++i) v[i] = x;
  return v;
}

// q . k for head sizes without a vector path (plain loop, in lanes of four).
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes4 acc = {};
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) acc += load<Lanes4>(a + d) * load<Lanes4>(b + d);
  float s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Cache rows are scattered over the cache's slots, so the hardware prefetcher does not see them
// coming: ask for a row a few keys ahead (a hint; it never faults, whatever the address).
template <int Lines>
__attribute__((always_inline)) inline void prefetch_row(const float* row) {
  for (int c = 0; c < Lines; ++c) __builtin_prefetch(row + 16 * c);
}

// Lane i of the result = the sum of v[i]'s lanes: W dot products finished together by halving
// pairs (a two-source shuffle pair and an add per step), instead of folding each on its own.
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

__attribute__((always_inline)) inline Lanes8 sum_each(Lanes8 v[8]) {
  Lanes8 u[4], w[2];
  for (int k = 0; k < 4; ++k)  // lanes 0-3 fold v[2k], lanes 4-7 fold v[2k+1]
    u[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)  // each pair of lanes folds one of v[4k .. 4k+3]
    w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(u[2 * k], u[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// scores[h L + l] = scale * q[h] . k[l] for the group's query heads h and keys l (D = W N),
// W keys at a time, every head before the next W keys, so each key row comes from memory once.
// slots[0 .. L) are the keys the row sees (a masked row's are gathered first, see attend).
//
// The W partial sums stay in registers: the block's key rows are picked first (a short last
// block repeats its first key, whose extra scores are dropped), so the loop over the block has
// no branch. With a `continue` for the short block's missing keys GCC kept them in a stack
// array, zeroed with `rep stos` and stored and reloaded for every key: 40% of the kernel's time
// (perf annotate at 400 keys). Each sum is computed exactly as before.
template <typename V, int N>
__attribute__((always_inline)) inline void score_keys(const float* q, int64_t group,
                                                      const float* k_cache, const int64_t* slots,
                                                      int64_t kv_heads, int64_t kvh, int64_t L,
                                                      float scale, float* scores) {
  constexpr int W = lanes<V>(), D = W * N;
  for (int64_t l0 = 0; l0 < L; l0 += W) {
    const int64_t n = std::min<int64_t>(W, L - l0);
    for (int64_t i = l0 + 16; i < std::min<int64_t>(L, l0 + 16 + W); ++i)
      prefetch_row<D / 16>(k_cache + (slots[i] * kv_heads + kvh) * D);
    const float* rows[W];
    for (int i = 0; i < W; ++i) rows[i] = k_cache + (slots[l0 + (i < n ? i : 0)] * kv_heads + kvh) * D;
    for (int64_t h = 0; h < group; ++h) {
      V qv[N];
      for (int c = 0; c < N; ++c) qv[c] = load<V>(q + h * D + W * c);
      V part[W];
#pragma GCC unroll 16
      for (int i = 0; i < W; ++i) {
        V acc = {};
#pragma GCC unroll 8
        for (int c = 0; c < N; ++c) acc += qv[c] * load<V>(rows[i] + W * c);
        part[i] = acc;
      }
      const V s = sum_each(part) * scale;
      if (n == W) {  // a whole block: one vector store (element stores cost 6%)
        std::memcpy(scores + h * L + l0, &s, sizeof s);
        continue;
      }
      for (int64_t i = 0; i < n; ++i) scores[h * L + l0 + i] = s[i];
    }
  }
}

// p[0 .. L) = exp(p - max p) in place; returns (max, sum of the exps): the softmax below, or
// a chunk's share of one whose other keys lie in other chunks (see attend_chunk).
template <typename V>
__attribute__((always_inline)) inline std::pair<float, float> exp_in_place(float* p, int64_t L) {
  // Reductions in explicit lanes: a plain float loop's max and sum stay scalar (their order
  // is fixed without -ffast-math), and the exp loop with them.
  constexpr int W = lanes<V>();
  V top = splat<V>(-std::numeric_limits<float>::infinity());
  int64_t l = 0;
  for (; l + W <= L; l += W) {
    const V s = load<V>(p + l);
    top = top > s ? top : s;
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < W; ++i) best = std::max(best, top[i]);
  for (; l < L; ++l) best = std::max(best, p[l]);
  for (l = 0; l < L; ++l) p[l] = specserve_kernels::vector_exp(p[l] - best);
  V sum = {};
  for (l = 0; l + W <= L; l += W) sum += load<V>(p + l);
  float total = 0.f;
  for (int i = 0; i < W; ++i) total += sum[i];
  for (; l < L; ++l) total += p[l];
  return {best, total};
}

// p[0 .. L) = softmax(p) in place; exactly 0 where p was -inf.
template <typename V>
__attribute__((always_inline)) inline void softmax_in_place(float* p, int64_t L) {
  const float inv = 1.f / exp_in_place<V>(p, L).second;
  for (int64_t l = 0; l < L; ++l) p[l] *= inv;
}

// out[h] = sum over keys l of p[h][l] * v[l] for G heads at once (D = W N), the sums
// held in registers; each value row is read once for all G heads.
template <typename V, int N, int G>
__attribute__((always_inline)) inline void weigh_values(const float* p, const float* v_cache,
                                                        const int64_t* slots, int64_t kv_heads,
                                                        int64_t kvh, int64_t L, float* out) {
  constexpr int W = lanes<V>(), D = W * N;
  V acc[G][N] = {};
  for (int64_t l = 0; l < L; ++l) {
    if (l + 16 < L) prefetch_row<D / 16>(v_cache + (slots[l + 16] * kv_heads + kvh) * D);
    const float* vr = v_cache + (slots[l] * kv_heads + kvh) * D;
    for (int i = 0; i < N; ++i) {
      // One vector at a time, never the array's address: GCC then keeps the sums in registers
      // (with a memcpy of the whole array it kept them on the stack, one store per FMA).
      const V v = load<V>(vr + W * i);
      for (int h = 0; h < G; ++h) acc[h][i] += p[h * L + l] * v;
    }
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < N; ++i) {
      const V a = acc[h][i];
      std::memcpy(out + h * D + W * i, &a, sizeof a);
    }
}

// Value sums for `group` heads, G of them per pass (G N registers of sums).
template <typename V, int N, int G>
__attribute__((always_inline)) inline void weigh_values_grouped(const float* p, const float* v_cache, const int64_t* slots,
                                 int64_t kv_heads, int64_t kvh, int64_t L,
                                 int64_t group, float* out) {
  constexpr int D = lanes<V>() * N;
  int64_t h = 0;
  for (; h + G <= group; h += G)
    weigh_values<V, N, G>(p + h * L, v_cache, slots, kv_heads, kvh, L, out + h * D);
  // The rest in one pass where it fits (SmolLM2: 3 query heads per KV head, G = 4): a pass
  // per head would read every value row again for each.
  const int64_t rest = group - h;
  if (rest == 3 && G > 3) {
    weigh_values<V, N, 3>(p + h * L, v_cache, slots, kv_heads, kvh, L, out + h * D);
    return;
  }
  if (rest == 2 && G > 2) {
    weigh_values<V, N, 2>(p + h * L, v_cache, slots, kv_heads, kvh, L, out + h * D);
    return;
  }
  for (; h < group; ++h)
    weigh_values<V, N, 1>(p + h * L, v_cache, slots, kv_heads, kvh, L, out + h * D);
}

// One sequence (group member) and one KV head: every query row of the member, for every query
// head sharing that KV head, attends to its visible keys. Head sizes of 64 and 128 take the
// vector paths; V is the build's vector (see Lanes16 above) and G its heads per value pass,
// as many as leave half the registers to the sums (AVX-512: 32 registers, AVX2: 16).
//
// A masked row first gathers its visible keys' slots into `kept` and attends to that list: the
// softmax's sums then run over exactly the keys the row sees, in order, so the row's result
// depends on those keys alone, not on how many hidden ones pad its step (a decode row, the same
// token verified among others, and a tree's branch give bitwise the same output; with the
// padding inside the sums, their lane order shifted with the padded length).
template <typename V, int G64, int G128>
__attribute__((always_inline)) inline void attend(const float* q, const float* k_cache,
                                                  const float* v_cache, const int64_t* rows,
                                                  const int64_t* all_slots, const bool* mask,
                                                  const bool* valid, Geometry g, int64_t kvh,
                                                  float scale, float* out, float* scores,
                                                  int64_t* kept) {
  const int64_t D = g.dim, group = g.heads / g.kv_heads;
  for (int64_t j = 0; j < g.queries; ++j) {
    if (valid && !valid[j]) continue;
    const int64_t* slots = all_slots;
    int64_t L = g.keys;
    if (mask) {
      const bool* visible = mask + j * g.keys;
      L = 0;
      for (int64_t l = 0; l < g.keys; ++l)
        if (visible[l]) kept[L++] = all_slots[l];
      slots = kept;
    }
    const float* qr = q + (rows[j] * g.heads + kvh * group) * D;  // the group's heads, adjacent
    float* o = out + (rows[j] * g.heads + kvh * group) * D;
    if (L == 0) {  // no visible key (a padding row): zeros, as SDPA gives no defined value
      std::fill(o, o + group * D, 0.f);
      continue;
    }
    if (D == 64) {
      score_keys<V, 64 / lanes<V>()>(qr, group, k_cache, slots, g.kv_heads, kvh, L, scale, scores);
    } else if (D == 128) {
      score_keys<V, 128 / lanes<V>()>(qr, group, k_cache, slots, g.kv_heads, kvh, L, scale, scores);
    } else {
      for (int64_t h = 0; h < group; ++h)
        for (int64_t l = 0; l < L; ++l) {
          const float* kr = k_cache + (slots[l] * g.kv_heads + kvh) * D;
          scores[h * L + l] = dot(qr + h * D, kr, D) * scale;
        }
    }
    for (int64_t h = 0; h < group; ++h) softmax_in_place<V>(scores + h * L, L);
    if (D == 64) {
      weigh_values_grouped<V, 64 / lanes<V>(), G64>(scores, v_cache, slots, g.kv_heads, kvh, L, group, o);
    } else if (D == 128) {
      weigh_values_grouped<V, 128 / lanes<V>(), G128>(scores, v_cache, slots, g.kv_heads, kvh, L, group, o);
    } else {
      std::fill(o, o + group * D, 0.f);
      for (int64_t h = 0; h < group; ++h) {
        const float* p = scores + h * L;
        float* oh = o + h * D;
        for (int64_t l = 0; l < L; ++l) {
          const float* vr = v_cache + (slots[l] * g.kv_heads + kvh) * D;
          for (int64_t d = 0; d < D; ++d) oh[d] += p[l] * vr[d];
        }
      }
    }
  }
}

// The keys a long row sees, split into chunks that run as tasks of their own (a decode row's
// three KV heads alone would split 2 + 1 over two threads): at most kChunkKeys keys a chunk,
// as even as possible. The split depends on the row's own key count only, never on its step,
// so a row still computes the same alone, verified or batched; rows of up to kChunkKeys keys
// run whole, exactly as before. (At 64 the chunks' combining cost more than the balance won
// at 150 keys: `python -m tests.attention_bench --sequences 1`.)
constexpr int64_t kChunkKeys = 256;

inline int64_t chunks_for(int64_t keys) { return keys <= kChunkKeys ? 1 : (keys + kChunkKeys - 1) / kChunkKeys; }

// Chunk c of n over `keys` keys: [first, first + count).
inline std::pair<int64_t, int64_t> chunk_range(int64_t keys, int64_t n, int64_t c) {
  const int64_t base = keys / n, extra = keys % n;
  return {c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
}

// One chunk of one row (KV head kvh): for each of the group's query heads, the chunk's max
// score and sum of exps (stats[2h], stats[2h + 1]) and the exp-weighted sum of its values
// (acc[h D .. h D + D)). Head sizes 64 and 128 only (cached_attention runs others whole).
template <typename V, int G64, int G128>
__attribute__((always_inline)) inline void attend_chunk(const float* q, const float* k_cache,
                                                        const float* v_cache, int64_t row,
                                                        const int64_t* slots, int64_t L,
                                                        Geometry g, int64_t kvh, float scale,
                                                        int64_t c, int64_t n, float* acc,
                                                        float* stats, float* scores) {
  // slots[0 .. L): the keys the row sees, in order (cached_attention gathers them once a row).
  const int64_t D = g.dim, group = g.heads / g.kv_heads;
  const auto [first, count] = chunk_range(L, n, c);
  slots += first;
  const float* qr = q + (row * g.heads + kvh * group) * D;
  if (D == 64)
    score_keys<V, 64 / lanes<V>()>(qr, group, k_cache, slots, g.kv_heads, kvh, count, scale, scores);
  else
    score_keys<V, 128 / lanes<V>()>(qr, group, k_cache, slots, g.kv_heads, kvh, count, scale, scores);
  for (int64_t h = 0; h < group; ++h) {
    const auto [top, sum] = exp_in_place<V>(scores + h * count, count);
    stats[2 * h] = top;
    stats[2 * h + 1] = sum;
  }
  if (D == 64)
    weigh_values_grouped<V, 64 / lanes<V>(), G64>(scores, v_cache, slots, g.kv_heads, kvh, count, group, acc);
  else
    weigh_values_grouped<V, 128 / lanes<V>(), G128>(scores, v_cache, slots, g.kv_heads, kvh, count, group, acc);
}

using AttendFn = void (*)(const float*, const float*, const float*, const int64_t*, const int64_t*,
                          const bool*, const bool*, Geometry, int64_t, float, float*, float*,
                          int64_t*);
using ChunkFn = void (*)(const float*, const float*, const float*, int64_t, const int64_t*,
                         int64_t, Geometry, int64_t, float, int64_t, int64_t, float*, float*,
                         float*);

__attribute__((target("avx512f")))
void chunk_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t row,
                  const int64_t* slots, int64_t L, Geometry g, int64_t kvh, float scale,
                  int64_t c, int64_t n, float* acc, float* stats, float* scores) {
  attend_chunk<Lanes16, 4, 2>(q, k_cache, v_cache, row, slots, L, g, kvh, scale, c, n, acc, stats, scores);
}

__attribute__((target("avx2,fma")))
void chunk_avx2(const float* q, const float* k_cache, const float* v_cache, int64_t row,
                const int64_t* slots, int64_t L, Geometry g, int64_t kvh, float scale,
                int64_t c, int64_t n, float* acc, float* stats, float* scores) {
  attend_chunk<Lanes8, 1, 1>(q, k_cache, v_cache, row, slots, L, g, kvh, scale, c, n, acc, stats, scores);
}

void chunk_baseline(const float* q, const float* k_cache, const float* v_cache, int64_t row,
                    const int64_t* slots, int64_t L, Geometry g, int64_t kvh, float scale,
                    int64_t c, int64_t n, float* acc, float* stats, float* scores) {
  attend_chunk<Lanes8, 1, 1>(q, k_cache, v_cache, row, slots, L, g, kvh, scale, c, n, acc, stats, scores);
}

ChunkFn chunk_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return chunk_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return chunk_avx2;
  return chunk_baseline;
}

// A chunked row's output from its chunks (in chunk order, whatever ran them): each head's
// softmax-weighted values, the chunks' exps rescaled to the largest score of all.
void combine_chunks(const float* acc, const float* stats, int64_t n, int64_t group, int64_t D,
                    float* out) {
  for (int64_t h = 0; h < group; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) top = std::max(top, stats[c * 2 * group + 2 * h]);
    float total = 0.f;
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float w = std::exp(stats[c * 2 * group + 2 * h] - top);
      total += w * stats[c * 2 * group + 2 * h + 1];
      const float* a = acc + (c * group + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

__attribute__((target("avx512f")))
void attend_avx512(const float* q, const float* k_cache, const float* v_cache, const int64_t* rows,
                   const int64_t* slots, const bool* mask, const bool* valid, Geometry g, int64_t kvh,
                   float scale, float* out, float* scores, int64_t* kept) {
  attend<Lanes16, 4, 2>(q, k_cache, v_cache, rows, slots, mask, valid, g, kvh, scale, out, scores, kept);
}

__attribute__((target("avx2,fma")))
void attend_avx2(const float* q, const float* k_cache, const float* v_cache, const int64_t* rows,
                 const int64_t* slots, const bool* mask, const bool* valid, Geometry g, int64_t kvh,
                 float scale, float* out, float* scores, int64_t* kept) {
  attend<Lanes8, 1, 1>(q, k_cache, v_cache, rows, slots, mask, valid, g, kvh, scale, out, scores, kept);
}

void attend_baseline(const float* q, const float* k_cache, const float* v_cache, const int64_t* rows,
                     const int64_t* slots, const bool* mask, const bool* valid, Geometry g, int64_t kvh,
                     float scale, float* out, float* scores, int64_t* kept) {
  attend<Lanes8, 1, 1>(q, k_cache, v_cache, rows, slots, mask, valid, g, kvh, scale, out, scores, kept);
}

// The widest build this CPU runs, chosen once.
AttendFn attend_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return attend_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return attend_avx2;
  return attend_baseline;
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
  static const AttendFn attend_here = attend_for_this_cpu();
  static const ChunkFn chunk_here = chunk_for_this_cpu();
  // One task per (member, KV head, query row), or per chunk of a long row's keys (chunks_for):
  // rows are independent (each computes exactly what it would alone), and a verification step
  // has few members, so tasks per row keep both cores busy: with one per (member, KV head),
  // SmolLM2's three KV heads split 2 + 1 over two threads whatever the rows, and each task
  // carried all of them; a decode row's chunks spread its keys the same way.
  const Geometry one_row{g.heads, g.kv_heads, g.dim, g.keys, 1};
  const int64_t group = g.heads / g.kv_heads, rows_total = members * g.kv_heads * g.queries;
  const bool chunkable = g.dim == 64 || g.dim == 128;
  // Chunks of each (member, KV head, row) task, and where its chunks' partial sums start.
  std::vector<int64_t> chunks(rows_total, 1), first_task(rows_total + 1, 0), part_at(rows_total, 0);
  // Each query row's visible keys (with a mask: gathered once here, shared by its KV heads'
  // chunks), as (first entry in `seen`, count).
  const int64_t query_rows = members * g.queries;
  std::vector<int64_t> seen, seen_at(query_rows, 0), seen_count(query_rows, g.keys);
  if (m && chunkable) {
    for (int64_t row = 0; row < query_rows; ++row) {
      seen_at[row] = seen.size();
      const int64_t* member_slots = slots + row / g.queries * g.keys;
      for (int64_t l = 0; l < g.keys; ++l)
        if (m[row * g.keys + l]) seen.push_back(member_slots[l]);
      seen_count[row] = seen.size() - seen_at[row];
    }
  }
  int64_t parts = 0;
  for (int64_t t = 0; t < rows_total; ++t) {
    const int64_t j = t % g.queries, i = t / (g.queries * g.kv_heads), row = i * g.queries + j;
    if (chunkable && !(ok && !ok[row])) chunks[t] = chunks_for(seen_count[row]);
    first_task[t + 1] = first_task[t] + chunks[t];
    part_at[t] = parts;
    if (chunks[t] > 1) parts += chunks[t];
  }
  const int64_t per_chunk = group * (g.dim + 2);  // a chunk's value sums and (max, sum) a head
  std::vector<float> partial(parts * per_chunk);
  const int64_t tasks = first_task[rows_total];
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * g.keys);
    std::vector<int64_t> kept(m ? g.keys : 0);
    // The row task holding flat task `begin`, then walked forward.
    int64_t t = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t f = begin; f < end; ++f) {
      while (f >= first_task[t + 1]) ++t;
      const int64_t j = t % g.queries, kvh = t / g.queries % g.kv_heads;
      const int64_t i = t / (g.queries * g.kv_heads), row = i * g.queries + j;
      if (chunks[t] == 1) {
        attend_here(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                    rows + row, slots + i * g.keys, m ? m + row * g.keys : nullptr,
                    ok ? ok + row : nullptr, one_row, kvh, float(scale), out.data_ptr<float>(),
                    scores.data(), kept.data());
        continue;
      }
      const int64_t c = f - first_task[t];
      float* base = partial.data() + (part_at[t] + c) * per_chunk;
      const int64_t* row_slots = m ? seen.data() + seen_at[row] : slots + i * g.keys;
      chunk_here(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), rows[row],
                 row_slots, seen_count[row], one_row, kvh, float(scale), c, chunks[t], base,
                 base + group * g.dim, scores.data());
    }
  });
  if (parts == 0) return;
  // Chunk c's sums sit at part_at + c: value sums [group * D], then (max, sum) per head. The
  // combine reads them in chunk order.
  at::parallel_for(0, rows_total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, stats;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = chunks[t];
      if (n == 1) continue;
      acc.resize(n * group * g.dim);
      stats.resize(n * 2 * group);
      for (int64_t c = 0; c < n; ++c) {
        const float* base = partial.data() + (part_at[t] + c) * per_chunk;
        std::copy(base, base + group * g.dim, acc.begin() + c * group * g.dim);
        std::copy(base + group * g.dim, base + per_chunk, stats.begin() + c * 2 * group);
      }
      const int64_t j = t % g.queries, kvh = t / g.queries % g.kv_heads;
      const int64_t i = t / (g.queries * g.kv_heads), row = i * g.queries + j;
      float* o = out.data_ptr<float>() + (rows[row] * g.heads + kvh * group) * g.dim;
      combine_chunks(acc.data(), stats.data(), n, group, g.dim, o);
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
