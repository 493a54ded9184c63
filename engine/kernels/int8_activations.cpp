// Products with 8-bit activations: the labelled opt-in that changes the model's numerics.
//
// The exact products (dequant_matmul.cpp) keep activations in float32 and rebuild each weight
// as a float before its multiply-add; on a CPU without AVX-512 that in-register dequantization,
// not memory, bounds a decode step. Here, as llama.cpp does, each row of x is quantized to
// 8-bit codes in blocks of 32 (one float scale per block: dx = max|x| / 127, q = round(x / dx))
// and each block's dot product with the weight's codes is an exact integer sum:
//
//   4-bit codes c, w = d c + m:   sum_j w_j x_j ~= d dx sum_j c_j q_j + m dx sum_j q_j
//   8-bit codes c, w = d c (+ m): the same over pieces of 16 inputs, each with its own d (and m)
//
// The result differs from the float32 product by the rounding of x to 8 bits, so this runs only
// where a user asked for it (model.int8_activations / --int8-activations). What does not change:
// every row of x is computed by the same operations in the same order whatever the number of
// rows, so a verification pass gives each position exactly what a decode step gives it, and
// speculative decoding stays lossless against these numerics.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "weight_rows.h"

#include <cmath>
#include <algorithm>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specserve_kernels {
namespace {

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kPiece = 16;  // inputs per 8-bit weight scale (at most)
constexpr int64_t kPrefetchAhead = 4096;  // bytes of weight codes read ahead of the tile

// x quantized row by row: codes, a scale per block of 32, and dx * (sum of codes) per piece of 16
// and per block of 32 (what a weight's min multiplies).
struct QuantizedRows {
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> dx;          // [M, K / 32]
  std::vector<float> dx_qsum16;   // [M, K / 16]
  std::vector<float> dx_qsum32;   // [M, K / 32]
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t B = K / kBlock;
  QuantizedRows out;
  out.q.resize(M * K);
  out.dx.resize(M * B);
  out.dx_qsum16.resize(M * 2 * B);
  out.dx_qsum32.resize(M * B);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < B; ++b) {
        const float* xb = x + m * K + b * kBlock;
        float amax = 0.f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = out.q.data() + m * K + b * kBlock;
        int sums[2] = {0, 0};
        for (int j = 0; j < kBlock; ++j) {
          // |x * inv| <= 127 up to rounding; clamp so a rounding up never wraps
          const float r = std::nearbyint(xb[j] * inv);  // ties to even
          qb[j] = int8_t(std::min(127.f, std::max(-127.f, r)));
          sums[j / kPiece] += qb[j];
        }
        out.dx[m * B + b] = d;
        out.dx_qsum16[m * 2 * B + 2 * b] = d * float(sums[0]);
        out.dx_qsum16[m * 2 * B + 2 * b + 1] = d * float(sums[1]);
        out.dx_qsum32[m * B + b] = d * float(sums[0] + sums[1]);
      }
  });
  return out;
}

// Inputs per scale of the weight: 32 (4-bit blocks, Q8_0) or 16 (Q6_K's sub-blocks).
int64_t group_size(const WeightRows& w) {
  return w.kind == CodeKind::U4 || w.i8_shift == 1 ? kBlock : kPiece;
}

// One weight row's scales and mins (zeros without) as float32.
void row_scales(const WeightRows& w, int64_t n, float* d, float* mins) {
  for (int64_t g = 0; g < w.groups; ++g) {
    d[g] = scale_at(w.scales, w.scales_f16, n * w.groups + g);
    mins[g] = w.mins ? scale_at(w.mins, w.scales_f16, n * w.groups + g) : 0.f;
  }
}

// The code of input k of a weight row (4-bit: unsigned 0..15; 8-bit: signed).
inline int32_t code_at(const WeightRows& w, const uint8_t* row, int64_t k) {
  if (w.kind == CodeKind::U4) {
    const uint8_t byte = row[16 * (k / 32) + k % 16];
    return k % 32 < 16 ? byte & 15 : byte >> 4;
  }
  return int8_t(row[k]);
}

// sum over groups g of (d_g dx) * (integer dot of group g) plus the mins' sum m_g dx sum(q), in
// a fixed order: even and odd blocks of 32 into separate partial sums, the mins apart.
float dot_row_portable(const WeightRows& w, const uint8_t* row, const float* sdx, const float* mins,
                       const int8_t* q, const float* dx_qsum) {
  const int64_t gs = group_size(w);
  float acc[2] = {0.f, 0.f}, min_sum = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    int32_t isum = 0;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) isum += code_at(w, row, k) * int32_t(q[k]);
    acc[(g * gs / kBlock) & 1] += sdx[g] * float(isum);
    min_sum += mins[g] * dx_qsum[g];
  }
  return (acc[0] + acc[1]) + min_sum;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// The four sums of a, b, c, d in lanes 0..3.
AVX2 inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// count float16 values as float32.
AVX2 void halves_to_floats(const uint16_t* h, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < count; ++i) out[i] = float(reinterpret_cast<const c10::Half*>(h)[i]);
}

// Scales and mins (if any) of weight rows n .. n + R - 1 as float32, R * G values each.
AVX2 void tile_scales_avx2(const WeightRows& w, int64_t n, int64_t R, float* d, float* mins) {
  if (!w.scales_f16) {
    for (int64_t r = 0; r < R; ++r) row_scales(w, n + r, d + r * w.groups, mins + r * w.groups);
    return;
  }
  const int64_t g0 = n * w.groups, count = R * w.groups;
  halves_to_floats(reinterpret_cast<const uint16_t*>(w.scales) + g0, count, d);
  if (w.mins) halves_to_floats(reinterpret_cast<const uint16_t*>(w.mins) + g0, count, mins);
}

// sdx = d * dx for R rows of G scales: dx has one value per group (groups of 32) or per two.
AVX2 void scales_times_dx_avx2(int64_t R, int64_t G, int64_t gs, const float* d, const float* dx, float* sdx) {
  for (int64_t r = 0; r < R; ++r) {
    const float* dr = d + r * G;
    float* out = sdx + r * G;
    int64_t g = 0;
    if (gs == kBlock)
      for (; g + 8 <= G; g += 8) _mm256_storeu_ps(out + g, _mm256_mul_ps(_mm256_loadu_ps(dr + g), _mm256_loadu_ps(dx + g)));
    for (; g < G; ++g) out[g] = dr[g] * dx[g * gs / kBlock];
  }
}

// Block b's 32 code-times-activation products as eight float sums of four: maddubs multiplies
// the unsigned codes by the signed activations into pairs of 16-bit sums (at most 2 * 128 * 127:
// no saturation), madd adds those into 32-bit sums (lanes 0-3 inputs 0-15, lanes 4-7 16-31).
template <bool U4>
AVX2 __attribute__((always_inline)) inline __m256 block_sums(const uint8_t* row, __m256i v, int64_t b) {
  __m256i c;
  if (U4) {  // 16 bytes: low nibbles are inputs 0-15, high nibbles 16-31
    const __m128i low4 = _mm_set1_epi8(15);
    const __m128i raw = _mm_loadu_si128((const __m128i*)(row + 16 * b));
    c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
  } else {  // signed codes: |c| times the activations carrying c's sign
    c = _mm256_loadu_si256((const __m256i*)(row + kBlock * b));
    v = _mm256_sign_epi8(v, c);
    c = _mm256_abs_epi8(c);
  }
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(c, v), _mm256_set1_epi16(1)));
}

// Block b's scales d dx for its eight sums: one per block, or one per piece of 16 (lanes 0-3, 4-7).
template <int64_t GS>
AVX2 __attribute__((always_inline)) inline __m256 block_scale(const float* sdx, int64_t b) {
  if (GS == kBlock) return _mm256_broadcast_ss(sdx + b);
  const __m256 pair = _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)(sdx + 2 * b))));
  return _mm256_permutevar8x32_ps(pair, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// One row of x against weight rows n .. n + R - 1, as dot_row_portable but a block of 32 inputs
// per step: the R rows share each loaded block of x and are R independent accumulator chains.
// sdx and mins hold R * G values (row r's from r * G). Each row's operations are the same
// whatever R, and whatever the other rows of x.
template <int R, bool U4, int64_t GS>
AVX2 void tile_avx2(const WeightRows& w, int64_t n, const float* sdx, const float* mins,
                    const int8_t* q, const float* dx_qsum, float* y) {
  const int64_t B = w.K / kBlock, G = w.groups;
  const uint8_t* rows = w.codes + n * w.code_row_bytes;
  // The rows a few tiles ahead, so the stream from memory overlaps the arithmetic (as in
  // dequant_matmul.cpp: the hardware prefetcher alone left a one-row product well below the
  // speed of reading its weights).
  for (int64_t o = 0; o < R * w.code_row_bytes; o += 64) __builtin_prefetch(rows + kPrefetchAhead + o, 0, 3);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + kBlock * b));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(block_sums<U4>(rows + r * w.code_row_bytes, v, b), block_scale<GS>(sdx + r * G, b), acc[r]);
  }
  __m256 sums[4];  // the rows' sums, and their mins' sums, four lanes at a time
  for (int r = 0; r < 4; ++r) sums[r] = r < R ? acc[r] : _mm256_setzero_ps();
  __m128 out = sum4_avx2(sums[0], sums[1], sums[2], sums[3]);
  if (w.mins) {
    for (int r = 0; r < 4; ++r) {
      sums[r] = _mm256_setzero_ps();
      if (r >= R) continue;
      int64_t g = 0;
      for (; g + 8 <= G; g += 8)
        sums[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + r * G + g), _mm256_loadu_ps(dx_qsum + g), sums[r]);
      float tail = 0.f;  // groups past the last eight, in lane 0
      for (; g < G; ++g) tail += mins[r * G + g] * dx_qsum[g];
      sums[r] = _mm256_add_ps(sums[r], _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
    }
    out = _mm_add_ps(out, sum4_avx2(sums[0], sums[1], sums[2], sums[3]));
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, out);
  for (int r = 0; r < R; ++r) y[r] = lanes[r];
}

template <bool U4, int64_t GS>
AVX2 void tile_any_avx2(int64_t R, const WeightRows& w, int64_t n, const float* sdx, const float* mins,
                        const int8_t* q, const float* dx_qsum, float* y) {
  switch (R) {
    case 4: return tile_avx2<4, U4, GS>(w, n, sdx, mins, q, dx_qsum, y);
    case 3: return tile_avx2<3, U4, GS>(w, n, sdx, mins, q, dx_qsum, y);
    case 2: return tile_avx2<2, U4, GS>(w, n, sdx, mins, q, dx_qsum, y);
    default: return tile_avx2<1, U4, GS>(w, n, sdx, mins, q, dx_qsum, y);
  }
}

// The tile for this weight's codes and scale groups (4-bit codes come in groups of 32).
AVX2 void tile_for_avx2(int64_t R, const WeightRows& w, int64_t n, const float* sdx, const float* mins,
                        const int8_t* q, const float* dx_qsum, float* y) {
  if (w.kind == CodeKind::U4) return tile_any_avx2<true, kBlock>(R, w, n, sdx, mins, q, dx_qsum, y);
  if (group_size(w) == kBlock) return tile_any_avx2<false, kBlock>(R, w, n, sdx, mins, q, dx_qsum, y);
  return tile_any_avx2<false, kPiece>(R, w, n, sdx, mins, q, dx_qsum, y);
}

bool avx2_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
bool avx2_usable() { return false; }
#endif

}  // namespace

bool int8_activations_supports(const WeightRows& w) {
  return (w.kind == CodeKind::U4 || w.kind == CodeKind::I8) && w.K % kBlock == 0;
}

std::vector<std::string> int8_activation_isas() {
  std::vector<std::string> out;
  if (avx2_usable()) out.push_back("avx2");
  out.push_back("portable");
  return out;
}

void int8_activations_matmul(const WeightRows& w, int64_t N, const float* x, int64_t M, float* y,
                             const std::string& isa) {
  TORCH_CHECK(int8_activations_supports(w),
              "8-bit activations need 4- or 8-bit codes and inputs in blocks of 32");
  const bool vector = isa == "avx2";
  TORCH_CHECK(!vector || avx2_usable(), "instruction set avx2 is not available on this CPU");
  TORCH_CHECK(vector || isa == "portable", "unknown instruction set for 8-bit activations: ", isa);
  const int64_t K = w.K, B = K / kBlock, G = w.groups, gs = group_size(w);
  const QuantizedRows xq = quantize_rows(x, M, K);
  constexpr int64_t kTile = 4;  // weight rows per pass
  at::parallel_for(0, (N + kTile - 1) / kTile, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> d(kTile * G), mins(kTile * G), sdx(kTile * G), out(kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTile, R = std::min(kTile, N - n);
#if defined(__x86_64__)
      if (vector) tile_scales_avx2(w, n, R, d.data(), mins.data());
      else
#endif
        for (int64_t r = 0; r < R; ++r) row_scales(w, n + r, d.data() + r * G, mins.data() + r * G);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* q = xq.q.data() + m * K;
        const float* dx = xq.dx.data() + m * B;
        const float* dx_qsum = gs == kBlock ? xq.dx_qsum32.data() + m * B : xq.dx_qsum16.data() + m * 2 * B;
#if defined(__x86_64__)
        if (vector) {
          scales_times_dx_avx2(R, G, gs, d.data(), dx, sdx.data());
          tile_for_avx2(R, w, n, sdx.data(), mins.data(), q, dx_qsum, out.data());
        } else
#endif
          for (int64_t r = 0; r < R; ++r) {
            for (int64_t g = 0; g < G; ++g) sdx[r * G + g] = d[r * G + g] * dx[g * gs / kBlock];
            out[r] = dot_row_portable(w, w.codes + (n + r) * w.code_row_bytes, sdx.data() + r * G,
                                      mins.data() + r * G, q, dx_qsum);
          }
        for (int64_t r = 0; r < R; ++r) y[m * N + n + r] = out[r];
      }
    }
  });
}

}  // namespace specserve_kernels
