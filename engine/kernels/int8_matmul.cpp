// Products with 8-bit activations and integer dot products: llama.cpp's numerics, an opt-in.
//
// y[M, N] = x[M, K] @ dequant(W)[N, K].T where each row of x is first rounded to 8 bits in
// blocks of 32 (scale = max|x| / 127 per block, as ggml's Q8 activations), and each block's
// integer dot product with the weight codes is exact. Against the exact float32 products
// (dequant_matmul.cpp) this does far less arithmetic per weight: a `vpdpbusd` multiplies 64
// code bytes by 64 activation bytes (AVX2's `vpmaddubsw` 32), so a decode row runs near the
// speed of reading the weights rather than of dequantizing them, and a few more rows
// (verification) cost less than they do there.
//
// Every row is computed alone: its quantization reads only that row, the integer sums are
// exact whatever their order, and the float steps per block run in one fixed order whatever
// M is. So a row's result never depends on the other rows (batch-invariant by construction),
// which is what keeps speculative decoding greedy-identical to plain decoding under these
// numerics: the 8-bit rounding would turn any last-bit difference into a different code.
//
// Weight layout ("x16", engine/models/int8_activations.py packs it at load): output rows in
// groups of 16, one 32-bit lane per row, so a block's 32 inputs are 8 groups of 4 bytes:
//   4-bit codes uint8 [N/16, K/32, 256]: 4 chunks of 64 bytes; byte i of lane l of chunk t
//                       holds weights 4t+i (low nibble) and 16+4t+i (high) of row 16g+l
//                       (the stored block's bytes 4t..4t+3, moved, not rewritten);
//   8-bit codes uint8 [N/16, K/32, 512]: 8 chunks; byte i of lane l of chunk t is weight 4t+i
//                       of row 16g+l plus 128 (vpdpbusd multiplies unsigned by signed bytes;
//                       the 128 * sum(activation codes) it adds is taken off exactly);
//   scales, mins        [N/16, K/32, 16] float16 or float32 (mins empty: none).
// Per block and row of x: acc += float(isum) * (d * dx) then acc += m * (dx * sum of the
// block's activation codes), as fused multiply-adds in that order (the portable path does the
// same operations with std::fma, so the two agree bitwise).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;    // weight rows per group
constexpr int kBlock = 32;    // inputs per scale
constexpr int kTileRows = 6;  // rows of x sharing one unpacking of a block

struct Packed {
  const uint8_t* codes;
  const void* scales;
  const void* mins;  // nullptr: none
  bool f16;          // scales (and mins) float16, else float32
  bool four_bit;
  int64_t groups, blocks;  // N / 16, K / 32
  int64_t block_bytes;     // 256 or 512
};

// x rounded to 8 bits: codes [M, K], and per block the scale dx and dx * sum(codes).
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> dx, sum;
  std::vector<int32_t> qsum;
  // AVX2 only: each block's 8 words of codes, each repeated 8 times (a 256-bit vector), so the
  // products read them as an operand instead of broadcasting them again for every group of
  // weight rows (3-8% faster products on a Zen 1).
  std::vector<int32_t> wide;
  int64_t K = 0, B = 0;
};

float scale_at(const void* p, bool f16, int64_t i) {
  return f16 ? float(reinterpret_cast<const c10::Half*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
}

// One block of 32 activations: max |x| / 127 as the scale, codes round(x * 127 / max) (to
// nearest, ties to even: what the vector conversion does in the default rounding mode).
void quantize_block(const float* x, int8_t* q, float& dx, float& sum, int32_t& qsum) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  dx = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int v = int(std::nearbyint(x[i] * inv));
    q[i] = int8_t(std::min(127, std::max(-127, v)));
    s += q[i];
  }
  qsum = s;
  sum = dx * float(s);
}

#if defined(__x86_64__)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

VNNI void quantize_block_avx512(const float* x, int8_t* q, float& dx, float& sum, int32_t& qsum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  dx = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // round to nearest even
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  qa = _mm512_max_epi32(neg, _mm512_min_epi32(lim, qa));
  qb = _mm512_max_epi32(neg, _mm512_min_epi32(lim, qb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));  // exact
  sum = dx * float(qsum);
}

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 inline __m256 scales_avx2(const void* p, bool f16, int64_t i) {
  if (f16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                   reinterpret_cast<const uint16_t*>(p) + i)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
}

// The portable quantize_block's operations eight lanes at a time (max and the products are
// exact; the conversion rounds to nearest even, as nearbyint does), so the codes are the same.
AVX2 void quantize_block_avx2(const float* x, int8_t* q, float& dx, float& sum, int32_t& qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  const float amax = _mm_cvtss_f32(t);
  dx = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  __m256i c[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    c[i] = _mm256_max_epi32(neg, _mm256_min_epi32(lim, c[i]));
    total = _mm256_add_epi32(total, c[i]);
  }
  // Packing works within 128-bit halves: the bytes come out in the order 0-3 8-11 16-19
  // 24-27 4-7 12-15 20-23 28-31 (in words of four), which the permute puts back.
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  qsum = _mm_cvtsi128_si32(s);  // exact
  sum = dx * float(qsum);
}
#endif

// The vector paths: none, AVX2 (byte products through vpmaddubsw), AVX-512 VNNI.
enum class Isa { portable, avx2, vnni };

bool has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#if defined(__x86_64__)
AVX2 void widen_words(Activations& a, int64_t M) {
  a.wide.resize(M * a.B * 64);
  const int32_t* words = reinterpret_cast<const int32_t*>(a.q.data());
  __m256i* out = reinterpret_cast<__m256i*>(a.wide.data());
  for (int64_t w = 0; w < M * a.B * 8; ++w) _mm256_storeu_si256(out + w, _mm256_set1_epi32(words[w]));
}
#endif

void quantize_rows(const float* x, int64_t M, int64_t K, Isa isa, Activations& a) {
  a.K = K;
  a.B = K / kBlock;
  a.q.resize(M * K);
  a.dx.resize(M * a.B);
  a.sum.resize(M * a.B);
  a.qsum.resize(M * a.B);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t i = r * a.B + b, o = r * K + b * kBlock;
#if defined(__x86_64__)
      if (isa == Isa::vnni) {
        quantize_block_avx512(x + o, a.q.data() + o, a.dx[i], a.sum[i], a.qsum[i]);
        continue;
      }
      if (isa == Isa::avx2) {
        quantize_block_avx2(x + o, a.q.data() + o, a.dx[i], a.sum[i], a.qsum[i]);
        continue;
      }
#endif
      quantize_block(x + o, a.q.data() + o, a.dx[i], a.sum[i], a.qsum[i]);
    }
#if defined(__x86_64__)
  if (isa == Isa::avx2) widen_words(a, M);
#endif
}

// ------------------------------------------------------------------- portable (reference)

// Rows r0 .. r0 + rows - 1 of x against the 16 weight rows of group g: the vector kernel's
// operations one lane at a time.
void group_portable(const Packed& w, int64_t g, const Activations& a, int64_t r0, int64_t rows,
                    float* y, int64_t ldy) {
  for (int64_t r = r0; r < r0 + rows; ++r)
    for (int l = 0; l < kLanes; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* c = w.codes + (g * w.blocks + b) * w.block_bytes;
        const int8_t* xq = a.q.data() + r * a.K + b * kBlock;
        int32_t isum = 0;
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < 4; ++i) {
            int code, k;
            if (w.four_bit) {
              const uint8_t byte = c[64 * (t & 3) + 4 * l + i];
              code = t < 4 ? byte & 15 : byte >> 4;
              k = t < 4 ? 4 * t + i : 16 + 4 * (t - 4) + i;
            } else {
              code = c[64 * t + 4 * l + i];
              k = 4 * t + i;
            }
            isum += code * xq[k];
          }
        if (!w.four_bit) isum -= 128 * a.qsum[r * a.B + b];
        const int64_t s = (g * w.blocks + b) * kLanes + l;
        const float dx = a.dx[r * a.B + b];
        acc = std::fma(float(isum), scale_at(w.scales, w.f16, s) * dx, acc);
        if (w.mins) acc = std::fma(scale_at(w.mins, w.f16, s), a.sum[r * a.B + b], acc);
      }
      y[r * ldy + g * kLanes + l] = acc;
    }
}

#if defined(__x86_64__)
// ---------------------------------------------------------------------- AVX-512 VNNI path

VNNI inline __m512 lanes_of(const void* p, bool f16, int64_t i) {
  if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                   reinterpret_cast<const uint16_t*>(p) + i)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
}

// R rows of x (from r0) against weight group g. The block's codes are unpacked once into
// eight vectors of bytes and each row's integer sums run as two chains (exact, so the split
// cannot change a result).
template <int R>
VNNI void group_avx512(const Packed& w, int64_t g, const Activations& a, int64_t r0, float* y,
                       int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  const uint8_t* base = w.codes + g * w.blocks * w.block_bytes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* c = base + b * w.block_bytes;
    // The next group's bytes are a few blocks ahead in memory: fetch them while this one runs.
    for (int64_t o = 0; o < w.block_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(c + 4096 + o), _MM_HINT_T0);
    __m512i wv[8];
    if (w.four_bit) {
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(c + 64 * t);
        wv[t] = _mm512_and_si512(v, low4);
        wv[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    } else {
      for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(c + 64 * t);
    }
    const int64_t s = (g * w.blocks + b) * kLanes;
    const __m512 d = lanes_of(w.scales, w.f16, s);
    const __m512 m = w.mins ? lanes_of(w.mins, w.f16, s) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r, i = row * a.B + b;
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + row * a.K + b * kBlock);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      // wv[t] holds inputs 4t .. 4t + 3 of the block (for 4-bit codes too: chunk t's high
      // nibbles, inputs 16 + 4t .., went to wv[t + 4]), so it pairs with activation word t.
      for (int t = 0; t < 8; t += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(xq[t]));
        s1 = _mm512_dpbusd_epi32(s1, wv[t + 1], _mm512_set1_epi32(xq[t + 1]));
      }
      __m512i isum = _mm512_add_epi32(s0, s1);
      if (!w.four_bit) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * a.qsum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[i])), acc[r]);
      if (w.mins) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy + g * kLanes, acc[r]);
}

VNNI void rows_avx512(const Packed& w, int64_t g, const Activations& a, int64_t r0, int64_t rows,
                      float* y, int64_t ldy) {
  switch (rows) {
    case 6: group_avx512<6>(w, g, a, r0, y, ldy); break;
    case 5: group_avx512<5>(w, g, a, r0, y, ldy); break;
    case 4: group_avx512<4>(w, g, a, r0, y, ldy); break;
    case 3: group_avx512<3>(w, g, a, r0, y, ldy); break;
    case 2: group_avx512<2>(w, g, a, r0, y, ldy); break;
    default: group_avx512<1>(w, g, a, r0, y, ldy); break;
  }
}

// -------------------------------------------------------------------------- AVX2 path

// R rows of x (from r0) against weight group g, in two halves of 8 rows (one 256-bit vector of
// 32-bit lanes each). vpmaddubsw multiplies unsigned by signed bytes and adds pairs into
// saturating 16-bit sums, so each half's products are kept where no sum can saturate:
//   4-bit codes (0..15) times activation codes (|x| <= 127): a pair is at most 3,810, and the
//     eight chunks' pairs add up to at most 30,480, so they are summed in 16 bits and widened
//     once (vpmaddwd by ones);
//   8-bit codes: the weight w = code - 128 goes in as |w| (at most 128, unsigned) against x
//     carrying w's sign (vpsignb), a pair at most 32,512, widened chunk by chunk. That sum is
//     sum(w x) itself, which the other paths reach as sum(code x) - 128 sum(x).
// The integer sums are exact, so they equal the portable path's; the float steps are the same.
template <int R>
AVX2 void group_avx2(const Packed& w, int64_t g, const Activations& a, int64_t r0, float* y,
                     int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* base = w.codes + g * w.blocks * w.block_bytes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* c = base + b * w.block_bytes;
    for (int64_t o = 0; o < w.block_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(c + 4096 + o), _MM_HINT_T0);
    const int64_t s = (g * w.blocks + b) * kLanes;
    for (int h = 0; h < 2; ++h) {
      // Chunk t's bytes of rows 8h .. 8h + 7 (wv[t]: inputs 4t .. 4t + 3, as in group_avx512).
      __m256i wv[8], sv[8];
      if (w.four_bit) {
        for (int t = 0; t < 4; ++t) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * t + 32 * h));
          wv[t] = _mm256_and_si256(v, low4);
          wv[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      } else {
        for (int t = 0; t < 8; ++t) {
          sv[t] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * t + 32 * h)), flip);
          wv[t] = _mm256_abs_epi8(sv[t]);  // -128 gives 0x80: 128 read unsigned
        }
      }
      const __m256 d = scales_avx2(w.scales, w.f16, s + 8 * h);
      const __m256 m = w.mins ? scales_avx2(w.mins, w.f16, s + 8 * h) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r, i = row * a.B + b;
        // The block's 8 words of activation codes, each in all 8 lanes (widen_words).
        const __m256i* xw = reinterpret_cast<const __m256i*>(a.wide.data()) + i * 8;
        __m256i isum;
        if (w.four_bit) {
          __m256i p = _mm256_maddubs_epi16(wv[0], _mm256_loadu_si256(xw));
          for (int t = 1; t < 8; ++t)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[t], _mm256_loadu_si256(xw + t)));
          isum = _mm256_madd_epi16(p, ones);
        } else {
          isum = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t) {
            const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(xw + t), sv[t]);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[t], x), ones));
          }
        }
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(a.dx[i])), acc[r][h]);
        if (w.mins) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[i]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (r0 + r) * ldy + g * kLanes + 8 * h, acc[r][h]);
}

AVX2 void rows_avx2(const Packed& w, int64_t g, const Activations& a, int64_t r0, int64_t rows,
                    float* y, int64_t ldy) {
  switch (rows) {
    case 6: group_avx2<6>(w, g, a, r0, y, ldy); break;
    case 5: group_avx2<5>(w, g, a, r0, y, ldy); break;
    case 4: group_avx2<4>(w, g, a, r0, y, ldy); break;
    case 3: group_avx2<3>(w, g, a, r0, y, ldy); break;
    case 2: group_avx2<2>(w, g, a, r0, y, ldy); break;
    default: group_avx2<1>(w, g, a, r0, y, ldy); break;
  }
}
#endif

Packed packed_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int8_matmul: codes must be a contiguous uint8 [N/16, K/32, 256 or 512] tensor");
  const int64_t bytes = codes.size(2);
  TORCH_CHECK(bytes == 256 || bytes == 512, "int8_matmul: a block of 16 rows is 256 (4-bit) or 512 (8-bit) bytes, not ", bytes);
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == codes.size(0) * codes.size(1) * kLanes &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "int8_matmul: scales must be float16 or float32 [N/16, K/32, 16]");
  const bool has_mins = mins.numel() > 0;
  TORCH_CHECK(!has_mins || (mins.is_contiguous() && mins.numel() == scales.numel() &&
                            mins.scalar_type() == scales.scalar_type()),
              "int8_matmul: mins must be empty or shaped and typed as the scales");
  return Packed{codes.data_ptr<uint8_t>(), scales.data_ptr(), has_mins ? mins.data_ptr() : nullptr,
                scales.scalar_type() == at::kHalf, bytes == 256, codes.size(0), codes.size(1), bytes};
}

at::Tensor int8_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, c10::string_view isa) {
  const Packed w = packed_weight(codes, scales, mins);
  const Isa path = isa == "avx512vnni" ? Isa::vnni : isa == "avx2" ? Isa::avx2 : Isa::portable;
  TORCH_CHECK(path != Isa::portable || isa == "portable", "int8_matmul: unknown instruction set '", std::string(isa), "'");
  TORCH_CHECK(path != Isa::vnni || has_vnni(), "int8_matmul: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(path != Isa::avx2 || has_avx2(), "int8_matmul: this CPU has no AVX2");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int8_matmul: x must be float32 [M, K]");
  const int64_t M = x_in.size(0), K = w.blocks * kBlock, N = w.groups * kLanes;
  TORCH_CHECK(x_in.size(1) == K, "int8_matmul: x has ", x_in.size(1), " inputs, the weight ", K);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  Activations a;
  quantize_rows(x.data_ptr<float>(), M, K, path, a);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, M - r0);
#if defined(__x86_64__)
        if (path == Isa::vnni) {
          rows_avx512(w, g, a, r0, rows, yp, N);
          continue;
        }
        if (path == Isa::avx2) {
          rows_avx2(w, g, a, r0, rows, yp, N);
          continue;
        }
#endif
        group_portable(w, g, a, r0, rows, yp, N);
      }
  });
  return y;
}

// The instruction sets int8_matmul takes here, best first ("portable" everywhere).
std::string int8_isas() {
  std::string isas;
  if (has_vnni()) isas += "avx512vnni,";
  if (has_avx2()) isas += "avx2,";
  return isas + "portable";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("int8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, str isa) -> Tensor");
  m.def("int8_isas() -> str", int8_isas);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("int8_matmul", int8_matmul); }
