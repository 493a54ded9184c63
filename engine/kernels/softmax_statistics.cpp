// A draft step's distribution and the two numbers its windows and gates read, in one pass
// over each row: softmax, its top probability and its entropy.
//
// Why: a trained drafter's draft step scores a few thousand columns, and the PyTorch ops for
// softmax, max and entropy (each a full pass, entropy's log on every column) took 60-70 us of
// a 0.7 ms draft at batch 1, more than the readout product that made the scores.
//
// With m the row's maximum, e_i = exp(z_i - m) and S their sum: p_i = e_i / S, the top
// probability is 1 / S (e of the maximum is exactly 1), and the entropy
// -sum p_i ln p_i = ln S - sum p_i (z_i - m), where columns with p_i = 0 (-inf scores) add 0.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "vector_exp.h"

namespace {

using specserve_kernels::vector_exp;

// One row: probabilities into p; returns (1 / S, entropy). Cloned per instruction set as the
// SiLU in layer_ops.cpp is: the build has no -march, and at SSE width this was 10 us a row.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
std::pair<float, float> softmax_row(const float* z, float* p, int64_t cols) {
  // Three loops the compiler vectorizes (the reductions by the simd pragmas: without them
  // the float sums would have to run in order, one column at a time).
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < cols; ++i) m = z[i] > m ? z[i] : m;
  for (int64_t i = 0; i < cols; ++i) p[i] = vector_exp(z[i] - m);
  float sum = 0.f, weighted = 0.f;
#pragma omp simd reduction(+ : sum, weighted)
  for (int64_t i = 0; i < cols; ++i) {
    sum += p[i];
    weighted += p[i] > 0.f ? p[i] * (z[i] - m) : 0.f;  // 0 * -inf would be NaN
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < cols; ++i) p[i] *= inv;
  const float h = std::log(sum) - weighted * inv;
  return {inv, h > 0.f ? h : 0.f};  // rounding can take the entropy just below 0
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_statistics(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "softmax_statistics: float32 [rows, columns] logits expected");
  const at::Tensor z = logits.contiguous();
  const int64_t rows = z.size(0), cols = z.size(1);
  at::Tensor probs = at::empty_like(z);
  at::Tensor top = at::empty({rows}, z.options());
  at::Tensor entropy = at::empty({rows}, z.options());
  for (int64_t r = 0; r < rows; ++r) {
    const auto [inv, h] =
        softmax_row(z.data_ptr<float>() + r * cols, probs.data_ptr<float>() + r * cols, cols);
    top.data_ptr<float>()[r] = inv;
    entropy.data_ptr<float>()[r] = h;
  }
  return {probs, top, entropy};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("softmax_statistics(Tensor logits) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("softmax_statistics", softmax_statistics); }
