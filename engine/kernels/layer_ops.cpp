// The small per-layer operations of a decoder layer, fused so that a decode step is a few
// dozen calls instead of hundreds of eager kernels (each costs a dispatch and, with two
// threads, a parallel region). Float32, CPU, contiguous rows; engine/models/llama.py keeps the
// plain PyTorch versions as the reference and the fallback.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "vector_exp.h"
#include <tuple>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              name, " must be float32 [rows, features] with contiguous rows");
}

void normalize_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  double sum = 0;  // a wide sum: the mean of squares is then exact to float32 rounding
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(sum / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// rms_norm(x) * weight, as transformers' LlamaRMSNorm computes it in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == at::kFloat, "weight must be [features]");
  const at::Tensor weight_c = weight.contiguous();  // lives as long as the pointer below
  const float* w = weight_c.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    normalize_row(x.data_ptr<float>() + r * x.stride(0), w, float(eps), n, out.data_ptr<float>() + r * n);
  return out;
}

// residual += delta (in place), then return rms_norm(residual) * weight: the residual add that
// ends a sublayer and the norm that starts the next one.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == delta.sizes(), "shape mismatch");
  const int64_t rows = residual.size(0), n = residual.size(1);
  at::Tensor out = at::empty({rows, n}, residual.options());
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == at::kFloat, "weight must be [features]");
  const at::Tensor weight_c = weight.contiguous();
  const float* w = weight_c.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* h = residual.data_ptr<float>() + r * n;
    const float* d = delta.data_ptr<float>() + r * delta.stride(0);
    for (int64_t i = 0; i < n; ++i) h[i] += d[i];
    normalize_row(h, w, float(eps), n, out.data_ptr<float>() + r * n);
  }
  return out;
}

// out[i] = silu(g[i]) * u[i]; cloned per instruction set so the exp vectorizes.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + specserve_kernels::vector_exp(-g[i])) * u[i];
}

// [rows, 2I] gate|up -> silu(gate) * up [rows, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      const float* u = g + inter;
      silu_mul_row(g, u, inter, out.data_ptr<float>() + r * inter);
    }
  });
  return out;
}

// From a fused q|k|v projection [T, (H + 2 KVH) * D]: rotate q and k by their positions'
// factors [T, D/2, 2] (cos, sin; adjacent pairs, see engine/models/rope.py), write k and v into
// the cache slots, and return (q [T, H, D], k [T, KVH, D], v [T, KVH, D]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_write_kv(
    const at::Tensor& qkv, const at::Tensor& factors, const at::Tensor& slots,
    at::Tensor& k_cache, at::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0);
  const int64_t D = k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width mismatch");
  TORCH_CHECK(factors.is_contiguous() && factors.scalar_type() == at::kFloat &&
                  factors.numel() == T * D, "factors must be float32 [T, D/2, 2]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kFloat, "caches must be contiguous float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "one slot per token");
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options());
  at::Tensor k = at::empty({T, num_kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({T, num_kv_heads, D}, qkv.options());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat,
              "v_cache must match k_cache");
  const at::Tensor slots_c = slots.contiguous();
  const int64_t* slot = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0), "cache slot ", slot[t], " out of range");
  const int64_t kv_row = num_kv_heads * D;
  for (int64_t t = 0; t < T; ++t) {
    const float* src = qkv.data_ptr<float>() + t * qkv.stride(0);
    const float* f = factors.data_ptr<float>() + t * D;
    auto rotate = [&](const float* in, float* out, int64_t heads) {
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const float a = in[h * D + 2 * i], b = in[h * D + 2 * i + 1];
          const float c = f[2 * i], s = f[2 * i + 1];
          out[h * D + 2 * i] = a * c - b * s;
          out[h * D + 2 * i + 1] = a * s + b * c;
        }
    };
    rotate(src, q.data_ptr<float>() + t * num_heads * D, num_heads);
    float* kt = k.data_ptr<float>() + t * kv_row;
    rotate(src + num_heads * D, kt, num_kv_heads);
    float* vt = v.data_ptr<float>() + t * kv_row;
    std::copy(src + (num_heads + num_kv_heads) * D, src + (num_heads + 2 * num_kv_heads) * D, vt);
    std::copy(kt, kt + kv_row, k_cache.data_ptr<float>() + slot[t] * kv_row);
    std::copy(vt, vt + kv_row, v_cache.data_ptr<float>() + slot[t] * kv_row);
  }
  return {q, k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_write_kv(Tensor qkv, Tensor factors, Tensor slots, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int num_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rope_write_kv", rope_write_kv);
}
