// Products against weights kept in their stored (block-quantized or half) form.
//
// y[M, N] = x[M, K] @ dequant(W)[N, K].T, float32 accumulation. Each output row n of W is
// dequantized once into a small float buffer (exactly as gguf-py/transformers dequantize it,
// so the result equals the float32-dequantized model up to summation order), then dotted with
// all M rows of x while the buffer sits in L1. One pass over the stored bytes serves every row of
// x, which is what keeps verification (a few rows) near the one-row cost.
//
// Weight layouts (engine/models/weight_formats.py builds them from GGUF blocks):
//   codes uint8 [N, K/2]  4-bit codes, blocks of 32: byte j of a block holds weights j (low
//                         nibble) and j + 16 (high nibble); w = scale * code + min
//   codes int8  [N, K]    8-bit codes, blocks of 16 or 32 (as many scales as blocks);
//                         w = scale * code (+ min if mins given)
//   codes half/bfloat16 [N, K]   plain half-precision rows (scales, mins empty)
//   scales, mins          [N, K / block] float16 or float32 (mins may be empty)
//
// The instruction set is picked at run time: AVX-512F, AVX2+FMA+F16C, or portable C++ that
// the compiler vectorizes for the target it was built for (NEON on aarch64).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "weight_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using specserve_kernels::CodeKind;
using specserve_kernels::WeightRows;
using specserve_kernels::scale_at;

// Weight rows are prefetched this many bytes ahead of the rows being multiplied. With the
// hardware prefetcher alone a one-row product from memory ran at about 60% of its in-cache
// speed on the Intel machine, as the stream from memory followed the arithmetic instead of
// overlapping it (docs/benchmarks.md); 2-8 KB ahead measured the same there.
constexpr int64_t kPrefetchAhead = 4096;

// Weight rows that share one pass of the one-row (decode) product; see one_row_tile_avx512.
constexpr int kOneRowTile = 4;
// The most rows of x that the few-rows product (few_rows_avx512) takes.
constexpr int64_t kFewRows = 8;

inline void prefetch_ahead(const uint8_t* rows, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(rows) + kPrefetchAhead;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// ---------------------------------------------------------------- portable (reference) path

void dequant_row_portable(const WeightRows& w, int64_t n, float* out) {
  const uint8_t* q = w.codes + n * w.code_row_bytes;
  const int64_t g0 = n * w.groups;
  switch (w.kind) {
    case CodeKind::U4:
      for (int64_t b = 0; b < w.groups; ++b) {
        const float d = scale_at(w.scales, w.scales_f16, g0 + b);
        const float m = scale_at(w.mins, w.scales_f16, g0 + b);
        for (int j = 0; j < 16; ++j) {
          out[32 * b + j] = float(q[16 * b + j] & 15) * d + m;
          out[32 * b + j + 16] = float(q[16 * b + j] >> 4) * d + m;
        }
      }
      break;
    case CodeKind::I8: {
      const int8_t* s = reinterpret_cast<const int8_t*>(q);
      for (int64_t b = 0; b < w.K / 16; ++b) {
        const int64_t g = g0 + (b >> w.i8_shift);
        const float d = scale_at(w.scales, w.scales_f16, g);
        const float m = w.mins ? scale_at(w.mins, w.scales_f16, g) : 0.f;
        for (int j = 0; j < 16; ++j) out[16 * b + j] = float(s[16 * b + j]) * d + m;
      }
      break;
    }
    case CodeKind::F16: {
      const c10::Half* h = reinterpret_cast<const c10::Half*>(q);
      for (int64_t k = 0; k < w.K; ++k) out[k] = float(h[k]);
      break;
    }
    case CodeKind::BF16: {
      const c10::BFloat16* h = reinterpret_cast<const c10::BFloat16*>(q);
      for (int64_t k = 0; k < w.K; ++k) out[k] = float(h[k]);
      break;
    }
  }
}

void dot_rows_portable(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: the compiler vectorizes
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      for (int j = 0; j < 8; ++j) acc[j] += xr[k + j] * w[k + j];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; k < K; ++k) sum += xr[k] * w[k];
    y[m * ldy] = sum;
  }
}

#if defined(__x86_64__)
// ----------------------------------------------------------------------------- AVX-512F path
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512 void halves_to_float_masked_avx512(const void* src, int64_t count, float* dst);

// Scales (or mins) g .. g + count - 1 (count <= 16) as float32: where they lie when stored as
// float32, else converted into buf in one vector pass. (Converting a float16 scale per block in
// scalar code cost more than the block's arithmetic: the tiled product spent a third of its
// time at 16 rows of x dequantizing.)
AVX512 inline const float* scales16(const void* p, bool f16, int64_t g, int64_t count, float* buf) {
  if (!f16) return reinterpret_cast<const float*>(p) + g;
  halves_to_float_masked_avx512(reinterpret_cast<const uint16_t*>(p) + g, count, buf);
  return buf;
}

AVX512 void dequant_row_avx512(const WeightRows& w, int64_t n, float* out) {
  const uint8_t* q = w.codes + n * w.code_row_bytes;
  const int64_t g0 = n * w.groups;
  float dbuf[16], mbuf[16];
  if (w.kind == CodeKind::U4) {
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t c = 0; c < w.groups; c += 16) {  // blocks c .. c + 15
      const int64_t count = std::min<int64_t>(16, w.groups - c);
      const float* ds = scales16(w.scales, w.scales_f16, g0 + c, count, dbuf);
      const float* ms = scales16(w.mins, w.scales_f16, g0 + c, count, mbuf);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t b = c + i;
        const __m512 d = _mm512_set1_ps(ds[i]), m = _mm512_set1_ps(ms[i]);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * b)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        _mm512_storeu_ps(out + 32 * b, _mm512_fmadd_ps(lo, d, m));  // d * code is exact
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_fmadd_ps(hi, d, m));
      }
    }
  } else if (w.kind == CodeKind::I8) {
    const int64_t pieces = w.K / 16, per_chunk = int64_t(16) << w.i8_shift;  // 16 scales' pieces
    for (int64_t c = 0; c < pieces; c += per_chunk) {
      const int64_t count = std::min<int64_t>(16, w.groups - (c >> w.i8_shift));
      const float* ds = scales16(w.scales, w.scales_f16, g0 + (c >> w.i8_shift), count, dbuf);
      const float* ms = w.mins ? scales16(w.mins, w.scales_f16, g0 + (c >> w.i8_shift), count, mbuf) : nullptr;
      for (int64_t b = c; b < std::min(pieces, c + per_chunk); ++b) {
        const int64_t i = (b - c) >> w.i8_shift;
        const __m512 d = _mm512_set1_ps(ds[i]);
        const __m512 m = ms ? _mm512_set1_ps(ms[i]) : _mm512_setzero_ps();
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * b)));
        _mm512_storeu_ps(out + 16 * b, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, m));
      }
    }
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(q);
    int64_t k = 0;
    for (; k + 16 <= w.K; k += 16) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(h + k));
      const __m512 f = w.kind == CodeKind::F16
          ? _mm512_cvtph_ps(v)
          : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
      _mm512_storeu_ps(out + k, f);
    }
    for (; k < w.K; ++k)
      out[k] = w.kind == CodeKind::F16 ? float(reinterpret_cast<const c10::Half*>(h)[k])
                                       : float(reinterpret_cast<const c10::BFloat16*>(h)[k]);
  }
}

// R rows of x against one dequantized weight row; U independent accumulators per row hide the
// FMA latency when R is small.
template <int R, int U>
AVX512 void dot_tile_avx512(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      const __m512 wv = _mm512_loadu_ps(w + k + 16 * u);
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16 * u), wv, acc[r][u]);
    }
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), wv, acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    float sum = _mm512_reduce_add_ps(acc[r][0]);
    for (int64_t t = k; t < K; ++t) sum += x[r * K + t] * w[t];
    y[r * ldy] = sum;
  }
}

AVX512 void dot_rows_avx512(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile_avx512<4, 1>(x + m * K, K, w, y + m * ldy, ldy);
  switch (M - m) {
    case 3: dot_tile_avx512<3, 1>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 2: dot_tile_avx512<2, 2>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 1: dot_tile_avx512<1, 4>(x + m * K, K, w, y + m * ldy, ldy); break;
    default: break;
  }
}


// This row's per-block scales and mins as float32 (float16 ones converted once per row), so the
// block loops broadcast them straight from memory.
struct RowScales {
  const float* d;
  const float* m;  // nullptr: no min
  int shift = 0;   // 8-bit codes: piece p of 16 inputs uses scale p >> shift
};

using HalvesToFloat = void (*)(const void* src, int64_t count, float* dst);

// Scales (and mins) of weight rows n .. n + R - 1 as float32 (R * G consecutive values), so the
// block loops broadcast them straight from memory: float32 ones where they lie, float16 ones
// converted into dbuf / mbuf by the instruction set's `convert`.
template <int R, HalvesToFloat convert>
__attribute__((always_inline)) inline RowScales tile_scales(const WeightRows& w, int64_t n, float* dbuf,
                                                            float* mbuf) {
  const int64_t g0 = n * w.groups, count = R * w.groups;
  if (!w.scales_f16)
    return {reinterpret_cast<const float*>(w.scales) + g0,
            w.mins ? reinterpret_cast<const float*>(w.mins) + g0 : nullptr, w.i8_shift};
  convert(reinterpret_cast<const uint16_t*>(w.scales) + g0, count, dbuf);
  if (w.mins) convert(reinterpret_cast<const uint16_t*>(w.mins) + g0, count, mbuf);
  return {dbuf, w.mins ? mbuf : nullptr, w.i8_shift};
}

// count float16 values to float32 (count need not be a multiple of 16).
AVX512 void halves_to_float_masked_avx512(const void* src, int64_t count, float* dst) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
  if (i < count) {
    const __mmask16 k = __mmask16((1u << (count - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + i)));
  }
}

template <int R>
AVX512 RowScales tile_scales_avx512(const WeightRows& w, int64_t n, float* dbuf, float* mbuf) {
  return tile_scales<R, halves_to_float_masked_avx512>(w, n, dbuf, mbuf);
}

// One 4-bit block: dequantize 32 weights in registers, accumulate into acc[r][2u], acc[r][2u+1].
// The block's 16 possible weights (code * d + m, code 0..15) are computed once into a vector,
// and each code picks its weight with a permute, which reads only the low four bits of each
// lane: no masking and no int-to-float conversion per weight.
template <int MR, int A>
AVX512 __attribute__((always_inline)) inline void u4_block_avx512(
    const uint8_t* q, RowScales s, int64_t b, const float* x, int64_t K, __m512 (&acc)[MR][A], int u) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(s.d[b]), _mm512_set1_ps(s.m[b]));
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * b)));
  const __m512 lo = _mm512_permutexvar_ps(v, table);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  for (int r = 0; r < MR; ++r) {
    acc[r][2 * u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + 32 * b), lo, acc[r][2 * u]);
    acc[r][2 * u + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + 32 * b + 16), hi, acc[r][2 * u + 1]);
  }
}

// One piece of 16 8-bit weights (piece b of the row) into acc[r][u].
template <int MR, int A>
AVX512 __attribute__((always_inline)) inline void i8_block_avx512(
    const uint8_t* q, RowScales s, int64_t b, const float* x, int64_t K, __m512 (&acc)[MR][A], int u) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * b)));
  const int64_t g = b >> s.shift;
  const __m512 d = _mm512_set1_ps(s.d[g]);
  const __m512 wv = s.m ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, _mm512_set1_ps(s.m[g]))
                        : _mm512_mul_ps(_mm512_cvtepi32_ps(v), d);
  for (int r = 0; r < MR; ++r)
    acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + 16 * b), wv, acc[r][u]);
}

// MR rows of x against one weight row, dequantizing each block in registers (no buffer):
// w = code * d + m exactly as stored, then float32 FMAs. U blocks are unrolled so a single row
// of x still has several independent accumulators.
template <int MR, int U>
AVX512 void fused_u4_avx512(const uint8_t* q, RowScales s, int64_t G, const float* x, int64_t K,
                            float* y, int64_t ldy) {
  __m512 acc[MR][2 * U];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < 2 * U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + U <= G; b += U)
    for (int u = 0; u < U; ++u) u4_block_avx512<MR>(q, s, b + u, x, K, acc, u);
  for (; b < G; ++b) u4_block_avx512<MR>(q, s, b, x, K, acc, 0);
  for (int r = 0; r < MR; ++r) {
    for (int u = 1; u < 2 * U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    y[r * ldy] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

template <int MR, int U>
AVX512 void fused_i8_avx512(const uint8_t* q, RowScales s, int64_t G, const float* x, int64_t K,
                            float* y, int64_t ldy) {
  __m512 acc[MR][U];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + U <= G; b += U)
    for (int u = 0; u < U; ++u) i8_block_avx512<MR>(q, s, b + u, x, K, acc, u);
  for (; b < G; ++b) i8_block_avx512<MR>(q, s, b, x, K, acc, 0);
  for (int r = 0; r < MR; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    y[r * ldy] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

// All M rows of x against weight row n, in tiles of up to four rows.
AVX512 void fused_row_avx512(const WeightRows& w, int64_t n, const float* x, int64_t M, float* y,
                             int64_t ldy, float* scratch) {
  const RowScales s = tile_scales_avx512<1>(w, n, scratch, scratch + w.groups);
  const uint8_t* q = w.codes + n * w.code_row_bytes;
  prefetch_ahead(q, w.code_row_bytes);
  const int64_t K = w.K, G = w.kind == CodeKind::U4 ? w.groups : K / 16;  // blocks, or pieces
  const bool u4 = w.kind == CodeKind::U4;
  // Up to eight rows share one in-register dequantization (32 vector registers hold eight
  // rows' accumulators): a verification pass of k + 1 <= 8 tokens dequantizes each block once.
  int64_t m = 0;
  for (; m + 8 <= M; m += 8)
    u4 ? fused_u4_avx512<8, 1>(q, s, G, x + m * K, K, y + m * ldy, ldy)
       : fused_i8_avx512<8, 1>(q, s, G, x + m * K, K, y + m * ldy, ldy);
  const float* xr = x + m * K;
  float* yr = y + m * ldy;
  switch (M - m) {
#define SPECSERVE_FUSED_CASE(R, U4U, I8U)                                  \
  case R:                                                                  \
    u4 ? fused_u4_avx512<R, U4U>(q, s, G, xr, K, yr, ldy)                  \
       : fused_i8_avx512<R, I8U>(q, s, G, xr, K, yr, ldy);                 \
    break;
    SPECSERVE_FUSED_CASE(7, 1, 1)
    SPECSERVE_FUSED_CASE(6, 1, 1)
    SPECSERVE_FUSED_CASE(5, 1, 1)
    SPECSERVE_FUSED_CASE(4, 1, 1)
    SPECSERVE_FUSED_CASE(3, 1, 2)
    SPECSERVE_FUSED_CASE(2, 1, 2)
    SPECSERVE_FUSED_CASE(1, 2, 4)
#undef SPECSERVE_FUSED_CASE
    default: break;
  }
}


// ------------------------------------------------------------------- one row of x (decode)
//
// A decode step multiplies one row of x by each weight, so every weight byte feeds a single FMA
// and the product runs at the rate of the in-register dequantization, not of the FMAs. Two
// things raise that rate: kOneRowTile weight rows share a pass (their blocks are independent
// chains the core overlaps, their scales convert in one vector pass, and their sums reduce
// together), and the rows further ahead are prefetched so the stream from memory overlaps the
// arithmetic instead of following it.
// The four sums of a, b, c, d in lanes 0..3.
AVX512 inline __m128 sum4_avx512(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// 8-bit block b of one weight row (scales from index g0) times x, into acc.
AVX512 __attribute__((always_inline)) inline void i8_one_row_block(
    const uint8_t* q, RowScales s, int64_t g0, int64_t b, const float* x, __m512& acc) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * b)));
  const int64_t g = g0 + (b >> s.shift);
  const __m512 d = _mm512_set1_ps(s.d[g]);
  const __m512 wv = s.m ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, _mm512_set1_ps(s.m[g]))
                        : _mm512_mul_ps(_mm512_cvtepi32_ps(v), d);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * b), wv, acc);
}

// One row of x against weight rows n .. n + kOneRowTile - 1; y[n + r] for each.
// 16 half-precision weights (k of them where k < 16) as float32.
AVX512 inline __m512 halves16_avx512(const uint16_t* h, bool f16, __mmask16 k) {
  const __m256i v = _mm256_maskz_loadu_epi16(k, h);
  return f16 ? _mm512_cvtph_ps(v) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

AVX512 void one_row_tile_avx512(const WeightRows& w, int64_t n, const float* x, float* y, float* scratch) {
  constexpr int R = kOneRowTile;
  const int64_t G = w.groups, row_bytes = w.code_row_bytes;
  const uint8_t* q = w.codes + n * row_bytes;
  prefetch_ahead(q, R * row_bytes);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  if (w.kind == CodeKind::F16 || w.kind == CodeKind::BF16) {  // plain rows: convert and FMA
    const bool f16 = w.kind == CodeKind::F16;
    const auto mask = [&](int64_t k) -> __mmask16 {  // inputs k .. k + 15 that exist
      return w.K - k >= 16 ? 0xFFFF : w.K <= k ? 0 : __mmask16((1u << (w.K - k)) - 1);
    };
    for (int64_t k = 0; k < w.K; k += 32) {
      const __mmask16 m0 = mask(k), m1 = mask(k + 16);
      const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + k), x1 = _mm512_maskz_loadu_ps(m1, x + k + 16);
      for (int r = 0; r < R; ++r) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(q + r * row_bytes) + k;
        acc[r][0] = _mm512_fmadd_ps(x0, halves16_avx512(h, f16, m0), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x1, halves16_avx512(h + 16, f16, m1), acc[r][1]);
      }
    }
    _mm_storeu_ps(y + n, sum4_avx512(_mm512_add_ps(acc[0][0], acc[0][1]), _mm512_add_ps(acc[1][0], acc[1][1]),
                                     _mm512_add_ps(acc[2][0], acc[2][1]), _mm512_add_ps(acc[3][0], acc[3][1])));
    return;
  }
  const RowScales s = tile_scales_avx512<R>(w, n, scratch, scratch + R * G);
  if (w.kind == CodeKind::U4) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b = 0; b < G; ++b) {
      const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
      for (int r = 0; r < R; ++r) {  // as u4_block_avx512: a 16-entry table, then permutes
        const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(s.d[r * G + b]), _mm512_set1_ps(s.m[r * G + b]));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + r * row_bytes + 16 * b)));
        acc[r][0] = _mm512_fmadd_ps(x0, _mm512_permutexvar_ps(v, table), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x1, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), acc[r][1]);
      }
    }
  } else {  // 8-bit codes in pieces of 16; even and odd pieces keep two accumulators per row busy
    const int64_t P = w.K / 16;  // pieces of 16 inputs
    int64_t b = 0;
    for (; b + 2 <= P; b += 2)
      for (int r = 0; r < R; ++r) {
        i8_one_row_block(q + r * row_bytes, s, r * G, b, x, acc[r][0]);
        i8_one_row_block(q + r * row_bytes, s, r * G, b + 1, x, acc[r][1]);
      }
    if (b < P)
      for (int r = 0; r < R; ++r) i8_one_row_block(q + r * row_bytes, s, r * G, b, x, acc[r][0]);
  }
  const __m128 sums = sum4_avx512(_mm512_add_ps(acc[0][0], acc[0][1]), _mm512_add_ps(acc[1][0], acc[1][1]),
                                  _mm512_add_ps(acc[2][0], acc[2][1]), _mm512_add_ps(acc[3][0], acc[3][1]));
  _mm_storeu_ps(y + n, sums);
}

// A few rows of x (verification of a few drafts): as the one-row tile, kOneRowTile weight rows
// per pass, each block's weights built once in registers and multiplied with every row of x,
// so the product stays near the speed of reading the weights instead of paying the dequantizing
// once per row of x. One accumulator per (row of x, weight row): with two or more rows of x
// there are enough independent chains, and up to 6 x 4 of them fit the registers with x read
// from L1 as each FMA's memory operand.
template <int M>
AVX512 void few_rows_tile_avx512(const WeightRows& w, int64_t n, const float* x, float* y,
                                 int64_t ldy, float* scratch) {
  constexpr int R = kOneRowTile;
  const int64_t G = w.groups, row_bytes = w.code_row_bytes, K = w.K;
  const uint8_t* q = w.codes + n * row_bytes;
  prefetch_ahead(q, R * row_bytes);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const RowScales s = tile_scales_avx512<R>(w, n, scratch, scratch + R * G);
  if (w.kind == CodeKind::U4) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b = 0; b < G; ++b) {
      for (int r = 0; r < R; ++r) {
        const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(s.d[r * G + b]), _mm512_set1_ps(s.m[r * G + b]));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + r * row_bytes + 16 * b)));
        const __m512 w0 = _mm512_permutexvar_ps(v, table);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        for (int m = 0; m < M; ++m) {  // x from L1: the registers hold the accumulators
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + 32 * b), w0, acc[m][r]);
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + 32 * b + 16), w1, acc[m][r]);
        }
      }
    }
  } else {  // 8-bit codes in pieces of 16
    for (int64_t b = 0; b < K / 16; ++b) {
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + r * row_bytes + 16 * b)));
        const int64_t g = r * G + (b >> s.shift);
        const __m512 d = _mm512_set1_ps(s.d[g]);
        const __m512 wv = s.m ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, _mm512_set1_ps(s.m[g]))
                              : _mm512_mul_ps(_mm512_cvtepi32_ps(v), d);
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + 16 * b), wv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm_storeu_ps(y + m * ldy + n, sum4_avx512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

// 2 .. kFewRows rows of x against weight rows n .. n + kOneRowTile - 1 (integer codes), in
// passes of at most kPassRows rows of x, as even as possible (7 = 4 + 3: a pass of one row of x
// would have too few independent accumulators).
constexpr int64_t kPassRows = 6;

AVX512 void few_rows_avx512(const WeightRows& w, int64_t n, const float* x, int64_t M, float* y,
                            int64_t ldy, float* scratch) {
  const int64_t passes = (M + kPassRows - 1) / kPassRows;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = (M - m) / (passes - p);
    const float* xm = x + m * w.K;
    float* ym = y + m * ldy;
    switch (rows) {
      case 6: few_rows_tile_avx512<6>(w, n, xm, ym, ldy, scratch); break;
      case 5: few_rows_tile_avx512<5>(w, n, xm, ym, ldy, scratch); break;
      case 4: few_rows_tile_avx512<4>(w, n, xm, ym, ldy, scratch); break;
      case 3: few_rows_tile_avx512<3>(w, n, xm, ym, ldy, scratch); break;
      default: few_rows_tile_avx512<2>(w, n, xm, ym, ldy, scratch); break;
    }
    m += rows;
  }
}

// Many rows of x (batches, prefill chunks): dequantize four weight rows into an L1 buffer, then
// a 4x4 register tile (four rows of x by four weight rows) makes each loaded vector feed four
// FMAs, so the product runs at FMA rather than load throughput.
template <int MR>
AVX512 void tile_avx512(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + K + k);
    const __m512 w2 = _mm512_loadu_ps(w + 2 * K + k), w3 = _mm512_loadu_ps(w + 3 * K + k);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm_storeu_ps(y + r * ldy, sum4_avx512(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// Weight rows n0 .. n0 + 3 against all M rows of x (K a multiple of 16).
AVX512 void tiled_rows_avx512(const WeightRows& w, int64_t n0, const float* x, int64_t M, float* y,
                              int64_t ldy, float* buf) {
  const int64_t K = w.K;
  for (int j = 0; j < 4; ++j) dequant_row_avx512(w, n0 + j, buf + j * K);
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_avx512<4>(x + m * K, K, buf, y + m * ldy + n0, ldy);
  switch (M - m) {
    case 3: tile_avx512<3>(x + m * K, K, buf, y + m * ldy + n0, ldy); break;
    case 2: tile_avx512<2>(x + m * K, K, buf, y + m * ldy + n0, ldy); break;
    case 1: tile_avx512<1>(x + m * K, K, buf, y + m * ldy + n0, ldy); break;
    default: break;
  }
}

// ------------------------------------------------------------------------ AVX2 + FMA + F16C
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2 void halves_to_float_avx2(const void* src, int64_t count, float* dst) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < count; ++i) dst[i] = float(reinterpret_cast<const c10::Half*>(h)[i]);
}

template <int R>
AVX2 RowScales tile_scales_avx2(const WeightRows& w, int64_t n, float* dbuf, float* mbuf) {
  return tile_scales<R, halves_to_float_avx2>(w, n, dbuf, mbuf);
}

// Most scale groups per row whose float16 scales dequant_row_avx2 converts in one vector pass
// (a scalar float16 conversion per block cost more than the block's own arithmetic).
constexpr int64_t kRowGroups = 512;

AVX2 void dequant_row_avx2(const WeightRows& w, int64_t n, float* out) {
  const uint8_t* q = w.codes + n * w.code_row_bytes;
  const int64_t g0 = n * w.groups;
  alignas(32) float dbuf[kRowGroups], mbuf[kRowGroups];
  const bool converted = w.kind != CodeKind::F16 && w.kind != CodeKind::BF16 && w.groups <= kRowGroups;
  const RowScales rs = converted ? tile_scales_avx2<1>(w, n, dbuf, mbuf) : RowScales{nullptr, nullptr};
  const float *ds = rs.d, *ms = rs.m;
  const auto scale = [&](int64_t g) { return ds ? ds[g] : scale_at(w.scales, w.scales_f16, g0 + g); };
  const auto min = [&](int64_t g) {
    return !w.mins ? 0.f : ms ? ms[g] : scale_at(w.mins, w.scales_f16, g0 + g);
  };
  if (w.kind == CodeKind::U4) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t b = 0; b < w.groups; ++b) {
      const __m256 d = _mm256_set1_ps(scale(b));
      const __m256 m = _mm256_set1_ps(min(b));
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * b + 8 * half)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(out + 32 * b + 8 * half, _mm256_fmadd_ps(lo, d, m));
        _mm256_storeu_ps(out + 32 * b + 16 + 8 * half, _mm256_fmadd_ps(hi, d, m));
      }
    }
  } else if (w.kind == CodeKind::I8) {
    for (int64_t b = 0; b < w.K / 16; ++b) {
      const int64_t g = b >> w.i8_shift;
      const __m256 d = _mm256_set1_ps(scale(g));
      const __m256 m = _mm256_set1_ps(min(g));
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * b + 8 * half)));
        _mm256_storeu_ps(out + 16 * b + 8 * half, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m));
      }
    }
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(q);
    int64_t k = 0;
    for (; k + 8 <= w.K; k += 8) {
      const __m128i v = _mm_loadu_si128((const __m128i*)(h + k));
      const __m256 f = w.kind == CodeKind::F16
          ? _mm256_cvtph_ps(v)
          : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
      _mm256_storeu_ps(out + k, f);
    }
    for (; k < w.K; ++k)
      out[k] = w.kind == CodeKind::F16 ? float(reinterpret_cast<const c10::Half*>(h)[k])
                                       : float(reinterpret_cast<const c10::BFloat16*>(h)[k]);
  }
}

template <int R, int U>
AVX2 void dot_tile_avx2(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U)
    for (int u = 0; u < U; ++u) {
      const __m256 wv = _mm256_loadu_ps(w + k + 8 * u);
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * u), wv, acc[r][u]);
    }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][u]);
    float sum = hsum256(acc[r][0]);
    for (int64_t t = k; t < K; ++t) sum += x[r * K + t] * w[t];
    y[r * ldy] = sum;
  }
}

AVX2 void dot_rows_avx2(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile_avx2<4, 1>(x + m * K, K, w, y + m * ldy, ldy);
  switch (M - m) {
    case 3: dot_tile_avx2<3, 1>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 2: dot_tile_avx2<2, 2>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 1: dot_tile_avx2<1, 4>(x + m * K, K, w, y + m * ldy, ldy); break;
    default: break;
  }
}

// As the AVX-512 version with 8 lanes: a 4-bit block is four vectors (weights 0-7, 8-15, 16-23,
// 24-31), which already gives a row four independent accumulators; 16 registers allow two rows.
template <int MR>
AVX2 void fused_u4_avx2(const uint8_t* q, RowScales s, int64_t G, const float* x, int64_t K,
                        float* y, int64_t ldy) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < G; ++b) {
    const __m256 d = _mm256_set1_ps(s.d[b]), m = _mm256_set1_ps(s.m[b]);
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * b + 8 * half)));
      const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), d, m);
      const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + 32 * b + 8 * half;
        acc[r][half] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), lo, acc[r][half]);
        acc[r][2 + half] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), hi, acc[r][2 + half]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    y[r * ldy] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                       _mm256_add_ps(acc[r][2], acc[r][3])));
}

template <int MR>
AVX2 void fused_i8_avx2(const uint8_t* q, RowScales s, int64_t G, const float* x, int64_t K,
                        float* y, int64_t ldy) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {  // G: pieces of 16 inputs
    const __m256 d = _mm256_set1_ps(s.d[b >> s.shift]);
    const __m256 m = s.m ? _mm256_set1_ps(s.m[b >> s.shift]) : _mm256_setzero_ps();
    const int u = int(b & 1) * 2;  // alternate accumulator pairs between pieces
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * b + 8 * half)));
      const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m);
      for (int r = 0; r < MR; ++r)
        acc[r][u + half] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + 16 * b + 8 * half), wv, acc[r][u + half]);
    }
  }
  for (int r = 0; r < MR; ++r)
    y[r * ldy] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                       _mm256_add_ps(acc[r][2], acc[r][3])));
}

AVX2 void fused_row_avx2(const WeightRows& w, int64_t n, const float* x, int64_t M, float* y,
                         int64_t ldy, float* scratch) {
  const RowScales s = tile_scales_avx2<1>(w, n, scratch, scratch + w.groups);
  const uint8_t* q = w.codes + n * w.code_row_bytes;
  prefetch_ahead(q, w.code_row_bytes);
  const int64_t K = w.K, G = w.kind == CodeKind::U4 ? w.groups : K / 16;  // blocks, or pieces
  const bool u4 = w.kind == CodeKind::U4;
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    u4 ? fused_u4_avx2<2>(q, s, G, x + m * K, K, y + m * ldy, ldy)
       : fused_i8_avx2<2>(q, s, G, x + m * K, K, y + m * ldy, ldy);
  if (m < M)
    u4 ? fused_u4_avx2<1>(q, s, G, x + m * K, K, y + m * ldy, ldy)
       : fused_i8_avx2<1>(q, s, G, x + m * K, K, y + m * ldy, ldy);
}

// The four sums of a, b, c, d in lanes 0..3.
AVX2 inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: a, b, c, d partial sums
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The four weight rows' sums of a tile's accumulators (A per weight row).
template <int A>
AVX2 inline __m128 tile_sums_avx2(const __m256* acc) {
  if (A == 1) return sum4_avx2(acc[0], acc[1], acc[2], acc[3]);
  return sum4_avx2(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]),
                   _mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7]));
}

// Many rows of x (batches, prefill chunks), as tiled_rows_avx512 with eight lanes: four weight
// rows dequantized into an L1 buffer, then a register tile of MR rows of x by the four weight
// rows, so each loaded x vector feeds four FMAs and each weight vector MR of them (the row-wise
// product loads an x vector per FMA, and loads, not FMAs, bound it).
template <int MR>
AVX2 void tile_avx2(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
    const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm_storeu_ps(y + r * ldy, sum4_avx2(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// Weight rows n0 .. n0 + 3 against all M rows of x (K a multiple of 8). Three rows of x per
// tile: 12 accumulators and the four weight vectors fill the 16 registers.
AVX2 void tiled_rows_avx2(const WeightRows& w, int64_t n0, const float* x, int64_t M, float* y,
                          int64_t ldy, float* buf) {
  const int64_t K = w.K;
  for (int j = 0; j < 4; ++j) dequant_row_avx2(w, n0 + j, buf + j * K);
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_avx2<3>(x + m * K, K, buf, y + m * ldy + n0, ldy);
  switch (M - m) {
    case 2: tile_avx2<2>(x + m * K, K, buf, y + m * ldy + n0, ldy); break;
    case 1: tile_avx2<1>(x + m * K, K, buf, y + m * ldy + n0, ldy); break;
    default: break;
  }
}

// 4-bit block b of M rows of x against weight row r of a tile: 32 weights dequantized in
// registers (w = code * d + m, as stored) as four vectors of eight, each fed to every row of x.
// With two accumulators per weight row (A = 2), acc[m][2r] takes weights 0-7 and 16-23 and
// acc[m][2r + 1] weights 8-15 and 24-31; with one, acc[m][r] takes all.
template <int M, int C>
AVX2 __attribute__((always_inline)) inline void u4_tile_block_avx2(
    const uint8_t* q, float d_, float m_, int64_t b, const float* x, int64_t K, __m256 (&acc)[M][C], int r) {
  const __m256 d = _mm256_set1_ps(d_), mn = _mm256_set1_ps(m_);
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m128i raw = _mm_loadu_si128((const __m128i*)(q + 16 * b));
  const __m256i v0 = _mm256_cvtepu8_epi32(raw), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
  const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low4)), d, mn);
  const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low4)), d, mn);
  const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d, mn);
  const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d, mn);
  constexpr int A = C / kOneRowTile;  // accumulators per weight row
  const int a0 = A * r, a1 = A * r + A - 1;
  for (int m = 0; m < M; ++m) {
    const float* xb = x + m * K + 32 * b;
    acc[m][a0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), w0, acc[m][a0]);
    acc[m][a1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w1, acc[m][a1]);
    acc[m][a0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w2, acc[m][a0]);
    acc[m][a1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w3, acc[m][a1]);
  }
}

// Piece b (16 inputs) of 8-bit weight row r of a tile against M rows of x.
template <int M, int C>
AVX2 __attribute__((always_inline)) inline void i8_tile_piece_avx2(
    const uint8_t* q, RowScales s, int64_t g0, int64_t b, const float* x, int64_t K, __m256 (&acc)[M][C], int r) {
  const int64_t g = g0 + (b >> s.shift);
  const __m256 d = _mm256_set1_ps(s.d[g]);
  const __m128i raw = _mm_loadu_si128((const __m128i*)(q + 16 * b));
  const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
  __m256 w0, w1;
  if (s.m) {
    const __m256 mn = _mm256_set1_ps(s.m[g]);
    w0 = _mm256_fmadd_ps(c0, d, mn), w1 = _mm256_fmadd_ps(c1, d, mn);
  } else {
    w0 = _mm256_mul_ps(c0, d), w1 = _mm256_mul_ps(c1, d);
  }
  constexpr int A = C / kOneRowTile;  // accumulators per weight row
  const int a0 = A * r, a1 = A * r + A - 1;
  for (int m = 0; m < M; ++m) {
    acc[m][a0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 16 * b), w0, acc[m][a0]);
    acc[m][a1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 16 * b + 8), w1, acc[m][a1]);
  }
}

// M rows of x (1 .. 3) against weight rows n .. n + kOneRowTile - 1, as the AVX-512 one-row
// and few-rows tiles with eight lanes: the tile's weight rows are independent accumulator
// chains, their scales convert in one pass, their sums reduce together, and the rows ahead are
// prefetched. Each weight block is dequantized once in registers for all M rows of x. With 16
// vector registers there are two accumulators per weight row for one row of x (eight chains
// hide the FMA latency) and one per (row of x, weight row) for two or three (up to 12).
template <int M>
AVX2 void rows_tile_avx2(const WeightRows& w, int64_t n, const float* x, float* y, int64_t ldy,
                         float* scratch) {
  constexpr int R = kOneRowTile;
  const int64_t G = w.groups, row_bytes = w.code_row_bytes, K = w.K;
  const uint8_t* q = w.codes + n * row_bytes;
  prefetch_ahead(q, R * row_bytes);
  constexpr int A = M == 1 ? 2 : 1;  // accumulators per weight row
  __m256 acc[M][A * R];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A * R; ++a) acc[m][a] = _mm256_setzero_ps();
  if (w.kind == CodeKind::F16 || w.kind == CodeKind::BF16) {  // plain rows: convert and FMA
    const bool f16 = w.kind == CodeKind::F16;
    const int64_t K16 = K & ~int64_t(15);
    for (int64_t k = 0; k < K16; k += 16)
      for (int r = 0; r < R; ++r) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(q + r * row_bytes) + k;
        const __m128i h0 = _mm_loadu_si128((const __m128i*)h), h1 = _mm_loadu_si128((const __m128i*)(h + 8));
        const __m256 w0 = f16 ? _mm256_cvtph_ps(h0) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
        const __m256 w1 = f16 ? _mm256_cvtph_ps(h1) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
        for (int m = 0; m < M; ++m) {
          acc[m][A * r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m][A * r]);
          acc[m][A * r + A - 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, acc[m][A * r + A - 1]);
        }
      }
    for (int m = 0; m < M; ++m) {
      float tail[R] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < R; ++r)
        for (int64_t k = K16; k < K; ++k) {
          const uint16_t* h = reinterpret_cast<const uint16_t*>(q + r * row_bytes);
          const float wk = f16 ? float(reinterpret_cast<const c10::Half*>(h)[k])
                               : float(reinterpret_cast<const c10::BFloat16*>(h)[k]);
          tail[r] += x[m * K + k] * wk;
        }
      _mm_storeu_ps(y + m * ldy + n, _mm_add_ps(tile_sums_avx2<A>(acc[m]), _mm_loadu_ps(tail)));
    }
    return;
  }
  const RowScales s = tile_scales_avx2<R>(w, n, scratch, scratch + R * G);
  if (w.kind == CodeKind::U4) {
    for (int64_t b = 0; b < G; ++b)
      for (int r = 0; r < R; ++r)
        u4_tile_block_avx2<M>(q + r * row_bytes, s.d[r * G + b], s.m[r * G + b], b, x, K, acc, r);
  } else {
    for (int64_t b = 0; b < K / 16; ++b)
      for (int r = 0; r < R; ++r) i8_tile_piece_avx2<M>(q + r * row_bytes, s, r * G, b, x, K, acc, r);
  }
  for (int m = 0; m < M; ++m) _mm_storeu_ps(y + m * ldy + n, tile_sums_avx2<A>(acc[m]));
}

AVX2 void one_row_tile_avx2(const WeightRows& w, int64_t n, const float* x, float* y, float* scratch) {
  rows_tile_avx2<1>(w, n, x, y, 0, scratch);
}

// Four to six rows of x against weight rows n, n + 1: each block's weights built once in
// registers, eight at a time, for all M rows (M x 2 accumulators and the weight vector fit the
// 16 registers), so a verification pass of four drafts dequantizes each weight once instead of
// once per pass of three rows.
template <int M>
AVX2 void rows_pair_avx2(const WeightRows& w, int64_t n, const float* x, float* y, int64_t ldy,
                         float* scratch) {
  constexpr int R = 2;
  const int64_t G = w.groups, row_bytes = w.code_row_bytes, K = w.K;
  const uint8_t* q = w.codes + n * row_bytes;
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const RowScales s = tile_scales_avx2<R>(w, n, scratch, scratch + R * G);
  if (w.kind == CodeKind::U4) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t b = 0; b < G; ++b)
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(s.d[r * G + b]), mn = _mm256_set1_ps(s.m[r * G + b]);
        const __m128i raw = _mm_loadu_si128((const __m128i*)(q + r * row_bytes + 16 * b));
        const __m256i v0 = _mm256_cvtepu8_epi32(raw), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
        const __m256i codes[4] = {_mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4),
                                  _mm256_srli_epi32(v0, 4), _mm256_srli_epi32(v1, 4)};
        for (int j = 0; j < 4; ++j) {
          const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes[j]), d, mn);
          for (int m = 0; m < M; ++m)
            acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 32 * b + 8 * j), wv, acc[m][r]);
        }
      }
  } else {  // 8-bit codes in pieces of 16
    for (int64_t b = 0; b < K / 16; ++b)
      for (int r = 0; r < R; ++r) {
        const int64_t g = r * G + (b >> s.shift);
        const __m256 d = _mm256_set1_ps(s.d[g]);
        const __m256 mn = s.m ? _mm256_set1_ps(s.m[g]) : _mm256_setzero_ps();
        const __m128i raw = _mm_loadu_si128((const __m128i*)(q + r * row_bytes + 16 * b));
        const __m256i codes[2] = {_mm256_cvtepi8_epi32(raw), _mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))};
        for (int j = 0; j < 2; ++j) {
          const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes[j]), d, mn);
          for (int m = 0; m < M; ++m)
            acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 16 * b + 8 * j), wv, acc[m][r]);
        }
      }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 sums = sum4_avx2(acc[m][0], acc[m][1], _mm256_setzero_ps(), _mm256_setzero_ps());
    y[m * ldy + n] = _mm_cvtss_f32(sums);
    y[m * ldy + n + 1] = _mm_cvtss_f32(_mm_shuffle_ps(sums, sums, 1));
  }
}

template <int M>
AVX2 void rows_pairs_avx2(const WeightRows& w, int64_t n, const float* x, float* y, int64_t ldy,
                          float* scratch) {
  for (int64_t p = 0; p < kOneRowTile; p += 2) rows_pair_avx2<M>(w, n + p, x, y, ldy, scratch);
}

// 2 .. kFewRows rows of x: two or three in one pass of four weight rows, four to six in passes
// of two weight rows, seven or eight as four and the rest.
AVX2 void few_rows_avx2(const WeightRows& w, int64_t n, const float* x, int64_t M, float* y,
                        int64_t ldy, float* scratch) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, rows = left > 6 ? 4 : left;
    const float* xm = x + m * w.K;
    float* ym = y + m * ldy;
    switch (rows) {
      case 6: rows_pairs_avx2<6>(w, n, xm, ym, ldy, scratch); break;
      case 5: rows_pairs_avx2<5>(w, n, xm, ym, ldy, scratch); break;
      case 4: rows_pairs_avx2<4>(w, n, xm, ym, ldy, scratch); break;
      case 3: rows_tile_avx2<3>(w, n, xm, ym, ldy, scratch); break;
      case 2: rows_tile_avx2<2>(w, n, xm, ym, ldy, scratch); break;
      default: rows_tile_avx2<1>(w, n, xm, ym, ldy, scratch); break;
    }
    m += rows;
  }
}

#endif  // __x86_64__

// ------------------------------------------------------------------------------ dispatching

using DequantRow = void (*)(const WeightRows&, int64_t, float*);
using DotRows = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t);
// All rows of x against weight row n without a dequantized buffer (integer codes only).
using FusedRow = void (*)(const WeightRows&, int64_t, const float*, int64_t, float*, int64_t, float*);
using TiledRows = FusedRow;
// One row of x against kOneRowTile weight rows from n.
using OneRowTile = void (*)(const WeightRows&, int64_t, const float*, float*, float*);
// 2 .. kFewRows rows of x against kOneRowTile weight rows from n (integer codes).
using FewRows = void (*)(const WeightRows&, int64_t, const float*, int64_t, float*, int64_t, float*);

struct Isa {
  const char* name;
  DequantRow dequant;
  DotRows dot;
  FusedRow fused;  // nullptr: dequantize the row, then dot
  TiledRows tiled;  // nullptr: none; else four weight rows at a time for many rows of x
  OneRowTile one_row = nullptr;  // nullptr: one row of x goes through ``fused``
  FewRows few_rows = nullptr;  // nullptr: a few rows of x go through ``fused``
};

Isa isa_by_name(const std::string& name) {
#if defined(__x86_64__)
  if (name == "avx512")
    return {"avx512",         dequant_row_avx512,  dot_rows_avx512, fused_row_avx512,
            tiled_rows_avx512, one_row_tile_avx512, few_rows_avx512};
  // The AMX product (amx_matmul.cpp) covers 4- and 8-bit codes; AVX-512 does the rest.
  if (name == "amx")
    return {"amx", dequant_row_avx512, dot_rows_avx512, fused_row_avx512, nullptr, one_row_tile_avx512};
  if (name == "avx2")
    return {"avx2",          dequant_row_avx2,  dot_rows_avx2, fused_row_avx2,
            tiled_rows_avx2, one_row_tile_avx2, few_rows_avx2};
  // One weight row at a time, dequantized in registers for every row of x.
  if (name == "avx2-rows") return {"avx2-rows", dequant_row_avx2, dot_rows_avx2, fused_row_avx2, nullptr};
#endif
  TORCH_CHECK(name == "portable", "unknown or unavailable instruction set ", name);
  return {"portable", dequant_row_portable, dot_rows_portable, nullptr, nullptr};
}

// Instruction sets usable here, fastest first; "<isa>-tiled" is that product with the register
// tile over dequantized weight rows for every row count (plain "<isa>" never tiles), so autotune
// can measure where the tile starts to pay; "amx" multiplies on AMX tiles (after the AVX-512
// ones, which stay the default before autotune has measured); "avx2-rows" is the AVX2 product
// one weight row at a time (no four-row tiles for one to eight rows of x: on an AMD EPYC with
// AVX2 only, neither form won every shape, so autotune decides).
std::vector<std::string> available_isas() {
  std::vector<std::string> out;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    out.push_back("avx512");
    out.push_back("avx512-tiled");
    if (specserve_kernels::amx_usable()) out.push_back("amx");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    for (const char* name : {"avx2", "avx2-tiled", "avx2-rows"}) out.push_back(name);
#endif
  out.push_back("portable");
  return out;
}

// An instruction set as a product names it, and whether the name asks for the tiled product.
struct NamedIsa {
  std::string name;
  Isa isa;
  bool tiled;
};

// The instruction set of a name. The usable ones are resolved once: a decode step runs about
// 120 products, and each one listed the CPU's instruction sets as strings to check its name.
const NamedIsa& checked_isa(c10::string_view isa_name) {
  static const std::vector<NamedIsa> usable = [] {
    std::vector<NamedIsa> out;
    const std::string suffix = "-tiled";
    for (const std::string& name : available_isas()) {
      const bool tiled = name.size() > suffix.size() &&
                         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
      out.push_back({name, isa_by_name(tiled ? name.substr(0, name.size() - suffix.size()) : name), tiled});
    }
    return out;
  }();
  for (const NamedIsa& named : usable)
    if (c10::string_view(named.name) == isa_name) return named;
  TORCH_CHECK(false, "instruction set ", std::string(isa_name), " is not available on this CPU");
}

WeightRows weight_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "codes must be a contiguous 2-D tensor");
  WeightRows w{};
  w.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  w.code_row_bytes = codes.size(1) * codes.element_size();
  switch (codes.scalar_type()) {
    case at::kByte: w.kind = CodeKind::U4; w.K = codes.size(1) * 2; break;
    case at::kChar: w.kind = CodeKind::I8; w.K = codes.size(1); break;
    case at::kHalf: w.kind = CodeKind::F16; w.K = codes.size(1); break;
    case at::kBFloat16: w.kind = CodeKind::BF16; w.K = codes.size(1); break;
    default: TORCH_CHECK(false, "unsupported code dtype ", codes.scalar_type());
  }
  if (w.kind == CodeKind::U4 || w.kind == CodeKind::I8) {
    // 4-bit codes: blocks of 32. 8-bit codes: blocks of 16 or 32, as the scales say.
    const int64_t per_row = codes.size(0) ? scales.numel() / codes.size(0) : 0;
    const int64_t block = w.kind == CodeKind::U4 ? 32 : per_row * 32 == w.K ? 32 : 16;
    TORCH_CHECK(w.K % block == 0, "K must be a multiple of ", block);
    w.groups = w.K / block;
    w.i8_shift = w.kind == CodeKind::I8 && block == 32 ? 1 : 0;
    TORCH_CHECK(scales.is_contiguous() && scales.numel() == codes.size(0) * w.groups,
                "scales must hold one value per block");
    TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
                "scales must be float16 or float32");
    w.scales = scales.data_ptr();
    w.scales_f16 = scales.scalar_type() == at::kHalf;
    if (mins.numel() > 0) {
      TORCH_CHECK(mins.is_contiguous() && mins.sizes() == scales.sizes() &&
                      mins.scalar_type() == scales.scalar_type(),
                  "mins must match scales");
      w.mins = mins.data_ptr();
    }
    TORCH_CHECK(w.kind == CodeKind::I8 || w.mins != nullptr, "4-bit codes need mins");
  }
  return w;
}

// A thread's scratch buffer of at least n floats, kept between products (they never nest):
// each call allocated and zero-filled a fresh one, up to 24 KB per thread for K = 1536.
float* scratch_floats(int64_t n) {
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Rows of W per parallel task: enough to amortise the task, few enough to balance two cores.
constexpr int64_t kRowGrain = 16;

at::Tensor dequant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mins, c10::string_view isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be 2-D float32");
  const WeightRows w = weight_rows(codes, scales, mins);
  TORCH_CHECK(x.size(1) == w.K, "x has ", x.size(1), " features, the weight ", w.K);
  const NamedIsa& named = checked_isa(isa_name);
  const Isa& isa = named.isa;
  const bool tiled_variant = named.tiled;
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = codes.size(0), K = w.K;
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (std::strcmp(isa.name, "amx") == 0 && specserve_kernels::amx_supports(w)) {
    specserve_kernels::amx_matmul(w, N, xp, M, yp);
    return y;
  }
  const bool fused = isa.fused && (w.kind == CodeKind::U4 || w.kind == CodeKind::I8);
  // Four weight rows share each loaded x vector (the tiled variant, where K allows).
  const bool tiled = tiled_variant && isa.tiled && K % 16 == 0;
  const bool one_row = M == 1 && isa.one_row != nullptr;
  const bool few_rows = !tiled && fused && M > 1 && M <= kFewRows && isa.few_rows != nullptr;
  const int64_t step = tiled ? 4 : one_row || few_rows ? kOneRowTile : 1;
  at::parallel_for(0, (N + step - 1) / step, std::max<int64_t>(kRowGrain / step, 1),
                   [&](int64_t begin, int64_t end) {
    float* row = scratch_floats(4 * K);  // dequantized weight rows (or a tile's scales), in L1
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * step;
      if (tiled && n + 4 <= N) {
        isa.tiled(w, n, xp, M, yp, N, row);
        continue;
      }
      if (one_row && n + kOneRowTile <= N) {
        isa.one_row(w, n, xp, yp, row);
        continue;
      }
      if (few_rows && n + kOneRowTile <= N) {
        isa.few_rows(w, n, xp, M, yp, N, row);
        continue;
      }
      for (int64_t r = n; r < std::min(n + step, N); ++r) {
        if (fused) {
          isa.fused(w, r, xp, M, yp + r, N, row);
          continue;
        }
        isa.dequant(w, r, row);
        isa.dot(xp, M, K, row, yp + r, N);
      }
    }
  });
  return y;
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                      c10::string_view isa_name) {
  const WeightRows w = weight_rows(codes, scales, mins);
  const Isa& isa = checked_isa(isa_name).isa;
  at::Tensor out = at::empty({codes.size(0), w.K}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, codes.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) isa.dequant(w, n, op + n * w.K);
  });
  return out;
}

// Rows ``rows`` of the weight, dequantized: an embedding lookup in one call (the row picks
// and the dequantization as separate PyTorch calls took about 40 us of a decode step).
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& mins, const at::Tensor& rows,
                           c10::string_view isa_name) {
  const WeightRows w = weight_rows(codes, scales, mins);
  const Isa& isa = checked_isa(isa_name).isa;
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "dequantize_rows: rows must be a 1-D int64 tensor");
  const at::Tensor picked = rows.contiguous();
  const int64_t* ids = picked.data_ptr<int64_t>();
  const int64_t count = picked.size(0), n_rows = codes.size(0);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n_rows, "dequantize_rows: row ", ids[i],
                " out of range for a weight of ", n_rows, " rows");
  }
  at::Tensor out = at::empty({count, w.K}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) isa.dequant(w, ids[i], op + i * w.K);
  });
  return out;
}

std::string cpu_isas() {
  std::string s;
  for (const auto& name : available_isas()) s += (s.empty() ? "" : ",") + name;
  return s;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("dequant_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, str isa) -> Tensor");
  m.def("dequantize(Tensor codes, Tensor scales, Tensor mins, str isa) -> Tensor");
  m.def(
      "dequantize_rows(Tensor codes, Tensor scales, Tensor mins, Tensor rows, str isa) -> Tensor");
  m.def("cpu_isas() -> str", cpu_isas);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("dequant_matmul", dequant_matmul);
  m.impl("dequantize", dequantize);
  m.impl("dequantize_rows", dequantize_rows);
}
