// A stored weight as the product kernels read it (see dequant_matmul.cpp for the layouts).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace specserve_kernels {

enum class CodeKind { U4, I8, F16, BF16 };

struct WeightRows {
  CodeKind kind;
  const uint8_t* codes;
  int64_t code_row_bytes;
  const void* scales;
  const void* mins;  // nullptr: no min
  bool scales_f16;
  int64_t groups;  // scale groups per row
  int64_t K;
  // 8-bit codes come in blocks of 16 or 32 inputs (Q6_K's sub-blocks, Q8_0's blocks); the
  // kernels walk them in pieces of 16, and piece p uses scale p >> i8_shift.
  int i8_shift = 0;
};

inline float scale_at(const void* p, bool f16, int64_t i) {
  return f16 ? float(reinterpret_cast<const c10::Half*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
}

// The AMX product (amx_matmul.cpp): y[M, N] = x[M, K] @ dequant(W).T for 4-bit and 8-bit codes.
bool amx_usable();
bool amx_supports(const WeightRows& w);
void amx_matmul(const WeightRows& w, int64_t N, const float* x, int64_t M, float* y);

}  // namespace specserve_kernels
