// The attention plan of a step whose sequences are all short chains over the paged cache
// (decode, verification of chains, a drafter's catch-up): the same tensors as
// ``engine.attention._cached_chains_group`` and ``_new_token_slots`` build, in one call.
//
// Why: the plan is built once per step (and once per draft step) in Python, and on a CPU a
// step's Python runs between two sweeps of the weights through the caches, three times slower
// than the same code in a loop. The Python builder's twenty-odd tensor calls took 0.10-0.15 ms
// of a 3.8 ms batch-1 decode step, and as much again in each of a drafter's passes.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// (slot_mapping [T], query_index [b, q], kv_slots [b, L], mask [b, 1, q, L] or empty when every
// key is seen, valid [b * q] or empty when no query is padding, output_rows [T]).
//
// Sequence i has num_cached[i] keys in the cache and num_new[i] new tokens, its block table at
// tables[offset .. offset + table_lengths[i]). Padding queries repeat the sequence's first row
// and see key 0 only; padding keys read slot 0 and are never seen. ``window`` < 0: no sliding
// window; else a query at position p sees keys in (p - window, p].
std::vector<at::Tensor> chain_attention_plan(
    c10::IntArrayRef num_cached, c10::IntArrayRef num_new, c10::IntArrayRef tables,
    c10::IntArrayRef table_lengths, int64_t block_size, int64_t window) {
  const int64_t b = static_cast<int64_t>(num_cached.size());
  TORCH_CHECK(b > 0, "chain_attention_plan: no sequences");
  TORCH_CHECK(static_cast<int64_t>(num_new.size()) == b &&
                  static_cast<int64_t>(table_lengths.size()) == b,
              "chain_attention_plan: one num_new and table length per sequence");
  TORCH_CHECK(block_size > 0, "chain_attention_plan: block_size must be positive");
  int64_t q_len = 0, kv_len = 0, rows = 0, table_total = 0;
  int64_t min_new = std::numeric_limits<int64_t>::max(), min_total = min_new;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = num_new[i], total = num_cached[i] + n;
    TORCH_CHECK(n >= 1 && num_cached[i] >= 0, "chain_attention_plan: bad sequence lengths");
    TORCH_CHECK(table_lengths[i] * block_size >= total,
                "chain_attention_plan: block table too short for ", total, " tokens");
    q_len = std::max(q_len, n);
    kv_len = std::max(kv_len, total);
    min_new = std::min(min_new, n);
    min_total = std::min(min_total, total);
    rows += n;
    table_total += table_lengths[i];
  }
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == table_total,
              "chain_attention_plan: tables hold ", tables.size(), " entries, lengths say ",
              table_total);

  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor slot_mapping = at::empty({rows}, longs);
  at::Tensor output_rows = at::empty({rows}, longs);
  at::Tensor query_index = at::empty({b, q_len}, longs);
  at::Tensor kv_slots = at::zeros({b, kv_len}, longs);
  int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int64_t* out_rows = output_rows.data_ptr<int64_t>();
  int64_t* queries = query_index.data_ptr<int64_t>();
  int64_t* keys = kv_slots.data_ptr<int64_t>();

  int64_t row = 0, offset = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t* table = tables.data() + offset;
    const int64_t n = num_new[i], cached = num_cached[i], total = cached + n;
    for (int64_t p = 0; p < total; ++p) {
      keys[i * kv_len + p] = table[p / block_size] * block_size + p % block_size;
    }
    for (int64_t j = 0; j < n; ++j) {
      slots[row + j] = keys[i * kv_len + cached + j];
      out_rows[row + j] = row + j;
    }
    for (int64_t j = 0; j < q_len; ++j) queries[i * q_len + j] = row + (j < n ? j : 0);
    row += n;
    offset += table_lengths[i];
  }

  const auto bools = at::TensorOptions().dtype(at::kBool);
  at::Tensor mask = at::empty({0}, bools);
  if (!(q_len == 1 && min_total == kv_len && window < 0)) {
    mask = at::empty({b, 1, q_len, kv_len}, bools);
    bool* seen = mask.data_ptr<bool>();
    bool every = true;
    for (int64_t i = 0; i < b; ++i) {
      const int64_t n = num_new[i], total = num_cached[i] + n;
      for (int64_t j = 0; j < q_len; ++j) {
        bool* line = seen + (i * q_len + j) * kv_len;
        if (j >= n) {  // padding: key 0 only, so its softmax stays finite
          for (int64_t k = 0; k < kv_len; ++k) line[k] = k == 0;
          every = every && kv_len == 1;
          continue;
        }
        const int64_t p = total - n + j;
        for (int64_t k = 0; k < kv_len; ++k) {
          line[k] = k <= p && (window < 0 || k > p - window);
          every = every && line[k];
        }
      }
    }
    if (every) mask = at::empty({0}, bools);
  }
  at::Tensor valid = at::empty({0}, bools);
  if (min_new < q_len) {
    valid = at::empty({b * q_len}, bools);
    bool* v = valid.data_ptr<bool>();
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t j = 0; j < q_len; ++j) v[i * q_len + j] = j < num_new[i];
    }
  }
  return {slot_mapping, query_index, kv_slots, mask, valid, output_rows};
}

}  // namespace

// No tensor arguments to dispatch on: registered with its schema, as a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def(
      "chain_attention_plan(int[] num_cached, int[] num_new, int[] tables, int[] table_lengths, "
      "int block_size, int window) -> Tensor[]",
      chain_attention_plan);
}
