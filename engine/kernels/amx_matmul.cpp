// Products on Intel AMX tiles that stay exact to the float32-dequantized weights.
//
// AMX multiplies bf16 tiles and accumulates in float32. Two facts make that exact here:
//  - a stored code is a small integer (4-bit 0..15, 8-bit -128..127), and every such integer is
//    a bf16 number; the block's scale and min are applied afterwards in float32;
//  - x is split into three bf16 pieces, x = hi + mid + lo (each the bf16 rounding of what the
//    previous ones left), which carry x's full 24-bit float32 significand. Each product
//    code * piece fits a float32 exactly, so the tile's float32 sums differ from the dequantized
//    float32 product only in summation order.
// Three tile products per block against one unpacked weight tile cost far less than float32
// FMAs once a few rows of x share the weight (verification, batches, prefill); autotune decides
// from how many rows on the machine at hand.
//
// Tiles: 0 = C, 16 weight rows x 16 rows of x (float32), the sum over one scale block;
// 1 = A, 16 weight rows x one block of codes (bf16, the weight's own row layout);
// 2, 3, 4 = B, one piece of x for that block, transposed into AMX's pair layout
//           (row k/2 holds x[n][k], x[n][k + 1] for the 16 rows n of x).
// Each block's C is scaled by the block's scale (and the block's sum of x times its min) in
// float32 vector registers.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "weight_rows.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SPECSERVE_AMX 1
#endif

namespace specserve_kernels {

#if SPECSERVE_AMX
namespace {

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

constexpr int64_t kT = 16;       // tile rows: weight rows per chunk, rows of x per group
constexpr int64_t kChunk = 32;   // inputs per transposed piece of x (one 4-bit block)
constexpr int64_t kPieceWords = kT * kChunk;  // bf16 words in one transposed piece

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512bw = (b >> 30) & 1, avx512f = (b >> 16) & 1;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!(avx512f && avx512bw && amx_bf16 && amx_tile)) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a >> 5) & 1;  // AVX512_BF16, for the float32 -> bf16 conversions
}

// Linux hands out AMX state only to processes that ask (ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool os_grants_amx() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

int64_t block_inputs(const WeightRows& w) { return w.kind == CodeKind::U4 ? 32 : 16 << w.i8_shift; }

AMX void configure_tiles(int64_t block) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  cfg.rows[0] = kT;
  cfg.colsb[0] = kT * 4;
  cfg.rows[1] = kT;
  cfg.colsb[1] = block * 2;
  for (int t = 2; t <= 4; ++t) {
    cfg.rows[t] = block / 2;
    cfg.colsb[t] = kT * 4;
  }
  _tile_loadconfig(&cfg);
}

// In-register transpose of a 16 x 16 matrix of 32-bit elements (r[i] = row i on entry,
// column i on exit): 32-bit, then 64-bit interleaves, then two rounds of 128-bit lane shuffles.
AMX inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

AMX inline __m512 bf16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x, split into bf16 pieces and transposed for the B tiles, plus per-block sums of x (for mins).
struct PreparedX {
  int64_t groups, chunks, blocks;
  std::vector<uint16_t> pieces;  // [group][chunk][piece][16 pairs][16 rows][2]
  std::vector<float> sums;       // [group][block][16 rows]; empty for weights without mins

  const uint16_t* piece(int64_t g, int64_t chunk, int p) const {
    return pieces.data() + ((g * chunks + chunk) * 3 + p) * kPieceWords;
  }
};

// Rows g*16 .. g*16+15 of x, inputs chunk*32 .. chunk*32+31 (zero past M and K).
AMX void prepare_chunk(const float* x, int64_t M, int64_t K, int64_t block, int64_t g, int64_t chunk,
                       PreparedX& out) {
  __m512i rows[3][kT];
  const int64_t k0 = chunk * kChunk;
  const int64_t left = std::min<int64_t>(kChunk, K - k0);
  const __mmask16 m0 = left >= 16 ? 0xFFFF : __mmask16((1u << left) - 1);
  const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : __mmask16((1u << (left - 16)) - 1);
  for (int64_t n = 0; n < kT; ++n) {
    const int64_t row = g * kT + n;
    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
    if (row < M) {
      x0 = _mm512_maskz_loadu_ps(m0, x + row * K + k0);
      x1 = _mm512_maskz_loadu_ps(m1, x + row * K + k0 + 16);
    }
    if (!out.sums.empty()) {  // block sums of x, for weights with mins
      float* sums = out.sums.data() + (g * out.blocks) * kT + n;
      if (block == 32) {
        if (chunk < out.blocks) sums[chunk * kT] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      } else {
        if (2 * chunk < out.blocks) sums[2 * chunk * kT] = _mm512_reduce_add_ps(x0);
        if (2 * chunk + 1 < out.blocks) sums[(2 * chunk + 1) * kT] = _mm512_reduce_add_ps(x1);
      }
    }
    for (int p = 0; p < 3; ++p) {
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // inputs 0..15, then 16..31
      rows[p][n] = h;
      x0 = _mm512_sub_ps(x0, bf16_to_float(_mm512_castsi512_si256(h)));  // exact residuals
      x1 = _mm512_sub_ps(x1, bf16_to_float(_mm512_extracti64x4_epi64(h, 1)));
    }
  }
  for (int p = 0; p < 3; ++p) {
    transpose16(rows[p]);  // row i now holds input pair i of all 16 rows of x
    uint16_t* dst = out.pieces.data() + ((g * out.chunks + chunk) * 3 + p) * kPieceWords;
    for (int i = 0; i < kT; ++i) _mm512_storeu_si512(dst + i * 32, rows[p][i]);
  }
}

PreparedX prepare_x(const float* x, int64_t M, int64_t K, int64_t block, int64_t blocks,
                    bool with_sums) {
  PreparedX out;
  out.groups = (M + kT - 1) / kT;
  out.chunks = (K + kChunk - 1) / kChunk;
  out.blocks = blocks;
  out.pieces.resize(out.groups * out.chunks * 3 * kPieceWords);
  if (with_sums) out.sums.resize(out.groups * blocks * kT);
  at::parallel_for(0, out.groups * out.chunks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      prepare_chunk(x, M, K, block, i / out.chunks, i % out.chunks, out);
  });
  return out;
}

// Weight rows f0 .. f0+15 as A tiles, one per block: abuf[block][16 rows][block inputs] bf16.
// 4-bit: byte j of a block holds inputs j and j + 16, so the bytes are widened twice into 32
// words, the second copy shifted right by four, and a 32-entry table maps each word's low five
// bits to the bf16 of its low four (the code).
AMX void unpack_weight_tiles(const WeightRows& w, int64_t f0, int64_t rows, uint16_t* abuf) {
  const int64_t block = block_inputs(w), G = w.groups;
  alignas(64) static const uint16_t shifts[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                   4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
  alignas(64) static const auto table = [] {
    std::array<uint16_t, 32> t{};
    for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(float(i & 15)).x;
    return t;
  }();
  const __m512i shift_v = _mm512_load_si512(shifts), table_v = _mm512_loadu_si512(table.data());
  for (int64_t f = 0; f < kT; ++f) {
    if (f >= rows) {
      for (int64_t b = 0; b < G; ++b) std::memset(abuf + (b * kT + f) * block, 0, block * 2);
      continue;
    }
    const uint8_t* q = w.codes + (f0 + f) * w.code_row_bytes;
    for (int64_t b = 0; b < G; ++b) {
      uint16_t* dst = abuf + (b * kT + f) * block;
      if (w.kind == CodeKind::U4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(q + 16 * b));
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_srlv_epi16(words, shift_v), table_v));
        continue;
      }
      for (int64_t piece = 0; piece < block / 16; ++piece) {  // int8: each code is a bf16 number
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(q + block * b + 16 * piece));
        const __m512 f32 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        _mm256_storeu_si256((__m256i*)(dst + 16 * piece), (__m256i)_mm512_cvtneps_pbh(f32));
      }
    }
  }
}

// count scales (or mins) from index i on as float32, zeros up to total (rows past the end of W).
AMX void float_scales(const void* src, bool f16, int64_t i, int64_t count, int64_t total, float* dst) {
  int64_t k = 0;
  if (f16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src) + i;
    for (; k + 16 <= count; k += 16)
      _mm512_storeu_ps(dst + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + k))));
  } else {
    std::memcpy(dst, reinterpret_cast<const float*>(src) + i, count * sizeof(float));
    k = count;
  }
  if (f16 && k < count) {  // the tail in one masked conversion, not a scalar one per value
    const __mmask16 m = __mmask16((1u << (count - k)) - 1);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src) + i + k;
    _mm512_mask_storeu_ps(dst + k, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h)));
    k = count;
  }
  for (; k < total; ++k) dst[k] = 0.f;
}

// y rows of x against weight rows f0 .. f0+15 (fewer at the end of W).
AMX void weight_chunk(const WeightRows& w, int64_t N, int64_t f0, const PreparedX& px, int64_t M,
                      float* y, uint16_t* abuf, float* dT, float* mT) {
  // dT, mT: [16 weight rows][G] float32 scales and mins
  const int64_t block = block_inputs(w), G = w.groups;
  const int64_t rows = std::min<int64_t>(kT, N - f0);
  unpack_weight_tiles(w, f0, rows, abuf);
  for (int64_t f = 0; f < kT; ++f) {
    float_scales(w.scales, w.scales_f16, (f0 + f) * G, f < rows ? G : 0, G, dT + f * G);
    if (w.mins) float_scales(w.mins, w.scales_f16, (f0 + f) * G, f < rows ? G : 0, G, mT + f * G);
  }
  alignas(64) float cbuf[kT * kT];
  const __mmask16 out_mask = rows >= 16 ? 0xFFFF : __mmask16((1u << rows) - 1);
  for (int64_t g = 0; g < px.groups; ++g) {
    __m512 acc[kT];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; ++b) {
      // This block's inputs within its 32-input chunk of prepared x: 8-bit blocks of 16 are
      // the first or second half of a chunk's pair rows.
      const int64_t chunk = b * block / kChunk, pair_row = (b * block % kChunk) / 2;
      _tile_zero(0);
      _tile_loadd(1, abuf + b * kT * block, block * 2);
      _tile_loadd(2, px.piece(g, chunk, 0) + pair_row * 32, 64);
      _tile_loadd(3, px.piece(g, chunk, 1) + pair_row * 32, 64);
      _tile_loadd(4, px.piece(g, chunk, 2) + pair_row * 32, 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(0, 1, 3);
      _tile_dpbf16ps(0, 1, 4);
      _tile_stored(0, cbuf, 64);
      for (int f = 0; f < kT; ++f)
        acc[f] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + f * kT), _mm512_set1_ps(dT[f * G + b]), acc[f]);
      if (w.mins) {
        const __m512 xs = _mm512_loadu_ps(px.sums.data() + (g * G + b) * kT);
        for (int f = 0; f < kT; ++f) acc[f] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mT[f * G + b]), acc[f]);
      }
    }
    // acc[f] holds weight row f for the 16 rows of x; transpose to rows of y.
    __m512i t[kT];
    for (int f = 0; f < kT; ++f) t[f] = _mm512_castps_si512(acc[f]);
    transpose16(t);
    for (int64_t n = 0; n < kT && g * kT + n < M; ++n)
      _mm512_mask_storeu_ps(y + (g * kT + n) * N + f0, out_mask, _mm512_castsi512_ps(t[n]));
  }
}

// Weight chunks begin .. end-1 on this thread (tile configuration is per thread).
AMX void weight_chunks(const WeightRows& w, int64_t N, int64_t begin, int64_t end, const PreparedX& px,
                       int64_t M, float* y) {
  const int64_t block = block_inputs(w);
  std::vector<uint16_t> abuf(kT * w.groups * block);
  std::vector<float> dT(kT * w.groups), mT(w.mins ? kT * w.groups : 0);
  configure_tiles(block);
  for (int64_t c = begin; c < end; ++c)
    weight_chunk(w, N, c * kT, px, M, y, abuf.data(), dT.data(), mT.data());
  _tile_release();
}

}  // namespace

bool amx_usable() {
  static const bool usable = cpu_has_amx_bf16() && os_grants_amx();
  return usable;
}

bool amx_supports(const WeightRows& w) {
  return w.kind == CodeKind::U4 || w.kind == CodeKind::I8;
}

void amx_matmul(const WeightRows& w, int64_t N, const float* x, int64_t M, float* y) {
  if (M == 0 || N == 0) return;
  const int64_t block = block_inputs(w), K = w.K;
  const PreparedX px = prepare_x(x, M, K, block, w.groups, w.mins != nullptr);
  at::parallel_for(0, (N + kT - 1) / kT, 1, [&](int64_t begin, int64_t end) {
    weight_chunks(w, N, begin, end, px, M, y);
  });
}

#else  // no AMX on this architecture or OS

bool amx_usable() { return false; }
bool amx_supports(const WeightRows&) { return false; }
void amx_matmul(const WeightRows&, int64_t, const float*, int64_t, float*) {}

#endif

}  // namespace specserve_kernels
