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
#include <limits>
#include <optional>
#include <vector>

namespace {

struct Geometry {
  int64_t heads, kv_heads, dim, keys, queries;
};

// q . k with 16 partial sums, which the compiler turns into vector lanes (a single running
// sum is a chain of dependent adds it may not reorder). Inlined into each clone below.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[d + j] * b[d + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += part[j];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// One sequence (group member) and one query head: every query row of the member attends to
// its visible keys. Cloned for AVX-512, AVX2 and baseline; the loader picks at run time.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_member_head(const float* q, const float* k_cache, const float* v_cache,
                        const int64_t* rows, const int64_t* slots, const bool* mask,
                        const bool* valid, Geometry g, int64_t h, float scale, float* out,
                        float* scores) {
  const int64_t D = g.dim, kvh = h / (g.heads / g.kv_heads);
  for (int64_t j = 0; j < g.queries; ++j) {
    if (valid && !valid[j]) continue;
    const float* qr = q + (rows[j] * g.heads + h) * D;
    const bool* visible = mask ? mask + j * g.keys : nullptr;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < g.keys; ++l) {
      if (visible && !visible[l]) continue;
      const float* kr = k_cache + (slots[l] * g.kv_heads + kvh) * D;
      scores[l] = dot(qr, kr, D) * scale;
      best = std::max(best, scores[l]);
    }
    float* o = out + (rows[j] * g.heads + h) * D;
    std::fill(o, o + D, 0.f);
    float total = 0.f;
    for (int64_t l = 0; l < g.keys; ++l) {
      if (visible && !visible[l]) continue;
      const float p = std::exp(scores[l] - best);
      total += p;
      const float* vr = v_cache + (slots[l] * g.kv_heads + kvh) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
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
  at::parallel_for(0, members * g.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g.keys);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / g.heads, h = t % g.heads;
      attend_member_head(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), rows + i * g.queries, slots + i * g.keys,
                         m ? m + i * g.queries * g.keys : nullptr,
                         ok ? ok + i * g.queries : nullptr, g, h, float(scale),
                         out.data_ptr<float>(), scores.data());
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
