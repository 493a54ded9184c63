// exp(x) for float32 in plain arithmetic the compiler vectorizes, for the softmax of attention
// and the SiLU of the MLP. A call to std::exp is a scalar library call in every loop it
// appears in: at batch 16 the softmax's calls alone took milliseconds per step.
//
// The usual construction (as in Cephes and in the vectorized exp PyTorch's own CPU kernels
// use): x = n ln2 + r with |r| <= ln2 / 2, exp(r) from a degree-6 polynomial, then 2^n put in
// the exponent bits. Relative error about 2e-7 (1-2 ulp), the accuracy of those kernels.
#pragma once

#include <cstdint>

namespace specserve_kernels {

inline float vector_exp(float x) {
  // Clamped so 2^n below stays a normal float; the selects at the end give exp's limits
  // (a masked score of -inf must give exactly 0). Selects, not early returns, so that a loop
  // calling this still vectorizes.
  constexpr float lowest = -87.33654f, highest = 88.72283f;
  const float xc = x < lowest ? lowest : (x > highest ? highest : x);
  // n = round(x / ln2) by the 1.5 * 2^23 trick: floorf would keep the loop from vectorizing.
  constexpr float round_shift = 12582912.f;
  const float n = (xc * 1.44269504088896341f + round_shift) - round_shift;
  // r = x - n ln2 in two steps (ln2 split so that n * 0.693359375 is exact).
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n for n in [-126, 128]: 2^128 is no float, so two factors 2^(n/2) and 2^(n - n/2).
  const int32_t ni = int32_t(n), half = ni >> 1;
  const float a = __builtin_bit_cast(float, (half + 127) << 23);
  const float b = __builtin_bit_cast(float, (ni - half + 127) << 23);
  const float e = p * a * b;
  return x < lowest ? 0.f : (x > highest ? __builtin_inff() : e);
}

}  // namespace specserve_kernels
