// Reductions over rows of scores that a step runs on its logits, each in one vectorized pass
// per row where the PyTorch ops took several, slower passes.
//
// softmax_statistics: a draft step's distribution and the two numbers its windows and gates
// read: softmax, its top probability and its entropy. Why: a trained drafter's draft step scores a few thousand columns, and the PyTorch ops for
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

// The first index of the row's maximum, or -1 if the row holds a NaN (the caller then asks
// PyTorch, whose max propagates NaN).
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
int64_t first_argmax_row(const float* z, int64_t cols) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;  // an int: a bool reduction keeps the loop from vectorizing
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < cols; ++i) {
    m = z[i] > m ? z[i] : m;
    nan |= z[i] != z[i];
  }
  if (nan) return -1;
  for (int64_t i = 0; i < cols; ++i) {
    if (z[i] == m) return i;
  }
  return 0;  // not reached: the maximum is one of the scores
}

// row_argmax: a greedy step's token per row, the first index of each row's maximum (argmax's
// choice among equals). torch.max over a 49,152-column row took 70 us of a 3.4 ms batch-1
// decode step.
at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "row_argmax: float32 [rows, columns] logits expected");
  TORCH_CHECK(logits.size(1) > 0, "row_argmax: rows must not be empty");
  const at::Tensor z = logits.contiguous();
  const int64_t rows = z.size(0), cols = z.size(1);
  at::Tensor out = at::empty({rows}, z.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    index[r] = first_argmax_row(z.data_ptr<float>() + r * cols, cols);
    if (index[r] < 0) index[r] = std::get<1>(z[r].max(0)).item<int64_t>();
  }
  return out;
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
  m.def("row_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("softmax_statistics", softmax_statistics);
  m.impl("row_argmax", row_argmax);
}
