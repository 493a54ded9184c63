// An EAGLE drafter's chain for one greedy request, drafted in one call.
//
// A drafted token costs the drafter's layer and head, a few MB of weights. Driven from Python
// it also cost some thirty operator calls and the interpreter's bookkeeping around them, and
// right after the target's pass (whose weights stream every cache empty) that glue took about
// as long as the products: 0.9-1.0 ms a token against 0.5 for the same pass run twice in a row
// (AMD Zen 4, 8-bit activations). DraftChain runs a whole chain here: each pass's entry (the
// token's embedding and the feature before it), the layer on the drafter's paged cache (a
// DecoderStack of its own), the head over the draft vocabulary and the greedy pick, until k
// tokens or one that ends the sequence. It calls the operators the Python path calls
// (engine/decoders/eagle.py and eagle3.py, drafting.py) in the same order, so the drafts are
// the same tokens; engine/decoders/draft_chain.py decides when it applies.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/view_as_real.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_stack.h"

namespace {

using specserve_kernels::DecoderStack;
using specserve_kernels::Ops;
using specserve_kernels::Part;
using specserve_kernels::Projection;

// How an entry's layer input is made from the token's embedding e and the feature f before it.
enum Entry : int64_t {
  kNormedPair = 0,  // EAGLE-3: q/k/v read [norm(e); norm(f)], the residual is f
  kProjected = 1,   // EAGLE: x = fc([e; f]) is both
};

enum OwnSlot : int64_t { kFc = 0, kHead = 1 };

class DraftChain : public torch::CustomClassHolder {
 public:
  // ``layer_eps``: the layer's norms' (the target's); the entry's and the head's are set_inputs'.
  DraftChain(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double layer_eps,
             int64_t entry, int64_t block_size)
      : layer_(num_heads, num_kv_heads, layer_eps),
        scale_(std::pow(double(head_dim), -0.5)),  // as Python's head_dim ** -0.5
        entry_(entry),
        block_size_(block_size) {
    TORCH_CHECK(entry == kNormedPair || entry == kProjected, "unknown entry kind ", entry);
  }

  // The drafter's layer, built as a DecoderStack is (engine/models/decoder_stack.py).
  int64_t add_layer(at::Tensor input_norm, at::Tensor post_attention_norm) {
    return layer_.add_layer(std::move(input_norm), std::move(post_attention_norm));
  }

  void add_part(int64_t layer, int64_t slot, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                std::optional<at::Tensor> bias, std::vector<int64_t> limits,
                std::vector<std::string> isas) {
    layer_.add_part(layer, slot, std::move(codes), std::move(scales), std::move(mins),
                    std::move(bias), std::move(limits), std::move(isas));
  }

  // A part of EAGLE's entry projection (kFc) or of the head over the draft vocabulary (kHead).
  void add_own_part(int64_t slot, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                    std::optional<at::Tensor> bias, std::vector<int64_t> limits,
                    std::vector<std::string> isas) {
    TORCH_CHECK(slot == kFc || slot == kHead, "no drafter projection slot ", slot);
    TORCH_CHECK(!limits.empty() && limits.size() == isas.size(), "a plan needs limits and kernels");
    Part part{std::move(codes), std::move(scales), std::move(mins),
              bias ? *bias : at::Tensor(), std::move(limits), std::move(isas)};
    (slot == kFc ? fc_ : head_).parts.push_back(std::move(part));
  }

  // The target's embedding (a stored weight and the isa dequantize_rows runs, or a dense
  // float32 table as ``embed_codes`` with no isa), its rope table
  // (complex [positions, head_dim / 2]), the draft vocabulary (ascending ids: the head's rows)
  // and the norms: EAGLE-3's of the embedding and the feature, the head's (undefined: none).
  void set_inputs(at::Tensor embed_codes, at::Tensor embed_scales, at::Tensor embed_mins,
                  std::string embed_isa, at::Tensor rope_table, at::Tensor draft_vocab,
                  std::optional<at::Tensor> embed_norm, std::optional<at::Tensor> hidden_norm,
                  std::optional<at::Tensor> head_norm, double norm_eps) {
    TORCH_CHECK(draft_vocab.scalar_type() == at::kLong && draft_vocab.dim() == 1,
                "the draft vocabulary must be int64 ids");
    TORCH_CHECK(entry_ != kNormedPair || (embed_norm && hidden_norm), "EAGLE-3's entry needs both norms");
    embed_codes_ = std::move(embed_codes);
    embed_scales_ = std::move(embed_scales);
    embed_mins_ = std::move(embed_mins);
    embed_isa_ = std::move(embed_isa);
    rope_table_ = std::move(rope_table);
    draft_vocab_ = draft_vocab.contiguous();
    embed_norm_ = embed_norm ? *embed_norm : at::Tensor();
    hidden_norm_ = hidden_norm ? *hidden_norm : at::Tensor();
    head_norm_ = head_norm ? *head_norm : at::Tensor();
    eps_ = norm_eps;
  }

  // Whether every product has a kernel for a first pass of ``rows`` entries and for the
  // one-entry passes after it.
  bool supports(int64_t rows) const {
    auto covered = [](const Projection& p, int64_t r) {
      for (const Part& part : p.parts)
        if (part.isa_for(r).empty()) return false;
      return true;
    };
    if (head_.parts.empty() || !covered(head_, 1)) return false;
    if (entry_ == kProjected && (fc_.parts.empty() || !covered(fc_, rows) || !covered(fc_, 1)))
      return false;
    return layer_.supports(rows) && layer_.supports(1);
  }

  // Drafts up to ``max_drafts`` tokens. The first pass reads ``ids`` [n] at positions
  // ``first_position`` .. + n - 1 with ``features`` [n, d] (each the feature before its
  // entry); every later pass reads the token just drafted with the guess before it. The
  // block table maps positions to the drafter's cache slots. Returns (tokens [m], their top
  // probabilities [m], entropies [m], the newest entry's output [d]); the chain stops after
  // a token of ``stop_ids``. Entries written: n + m - 1.
  std::vector<at::Tensor> draft(at::Tensor ids, int64_t first_position, at::Tensor features,
                                std::vector<int64_t> block_table, std::vector<at::Tensor> kv_caches,
                                int64_t max_drafts, std::vector<int64_t> stop_ids) {
    TORCH_CHECK(max_drafts >= 1, "draft at least one token");
    TORCH_CHECK(ids.dim() == 1 && ids.size(0) >= 1 && features.dim() == 2 &&
                    features.size(0) == ids.size(0),
                "one feature row per entry");
    const Ops& ops = Ops::get();
    const int64_t table_length = int64_t(block_table.size());
    const int64_t* vocab = draft_vocab_.data_ptr<int64_t>();
    std::vector<int64_t> tokens;
    std::vector<float> tops, entropies;
    at::Tensor pass_ids = ids, feats = features, guess;
    int64_t position = first_position;
    while (true) {
      const int64_t n = pass_ids.size(0);
      const at::Tensor embeddings = embed_isa_.empty()
          ? embed_codes_.index_select(0, pass_ids)  // a dense table
          : ops.dequantize_rows.call(embed_codes_, embed_scales_, embed_mins_, pass_ids, embed_isa_);
      at::Tensor hidden;
      std::optional<at::Tensor> qkv_input;
      if (entry_ == kNormedPair) {
        qkv_input = at::cat({ops.rms_norm.call(embeddings, embed_norm_, eps_),
                             ops.rms_norm.call(feats, hidden_norm_, eps_)}, 1);
        hidden = feats.clone();  // the layer updates it in place
      } else {
        hidden = DecoderStack::run(ops, fc_, at::cat({embeddings, feats}, 1), n);
      }
      const std::vector<at::Tensor> plan =
          ops.chain_plan.call({position}, {n}, block_table, {table_length}, block_size_, -1);
      // (slots, query index, kv slots, mask, valid, output rows); empty: none
      const std::optional<at::Tensor> mask =
          plan[3].numel() ? std::optional<at::Tensor>(plan[3]) : std::nullopt;
      const std::optional<at::Tensor> valid =
          plan[4].numel() ? std::optional<at::Tensor>(plan[4]) : std::nullopt;
      const at::Tensor positions = at::arange(position, position + n, pass_ids.options());
      const at::Tensor rope = at::view_as_real(rope_table_.index_select(0, positions).unsqueeze(1));
      layer_.forward(hidden, rope, plan[0], kv_caches, plan[1], plan[2], mask, valid, scale_, {0},
                     {1}, {1}, {}, qkv_input);
      guess = hidden.narrow(0, n - 1, 1).clone();  // [1, d]
      const at::Tensor read = head_norm_.defined() ? ops.rms_norm.call(guess, head_norm_, eps_) : guess;
      const at::Tensor scores = DecoderStack::run(ops, head_, read, 1);
      const auto [dists, top, entropy] = ops.softmax_statistics.call(scores);
      const int64_t token = vocab[ops.row_argmax.call(scores).data_ptr<int64_t>()[0]];
      tokens.push_back(token);
      tops.push_back(top.data_ptr<float>()[0]);
      entropies.push_back(entropy.data_ptr<float>()[0]);
      position += n;
      const bool stops = std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end();
      if (int64_t(tokens.size()) >= max_drafts || stops) break;
      pass_ids = at::tensor({token}, ids.options());
      feats = guess;
    }
    return {at::tensor(tokens, ids.options()), at::tensor(tops, features.options()),
            at::tensor(entropies, features.options()), guess.view({-1})};
  }

 private:
  DecoderStack layer_;
  Projection fc_, head_;
  at::Tensor embed_codes_, embed_scales_, embed_mins_, rope_table_, draft_vocab_;
  at::Tensor embed_norm_, hidden_norm_, head_norm_;
  std::string embed_isa_;
  double scale_, eps_ = 0;
  int64_t entry_, block_size_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.class_<DraftChain>("DraftChain")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t, int64_t>())
      .def("add_layer", &DraftChain::add_layer)
      .def("add_part", &DraftChain::add_part)
      .def("add_own_part", &DraftChain::add_own_part)
      .def("set_inputs", &DraftChain::set_inputs)
      .def("supports", &DraftChain::supports)
      .def("draft", &DraftChain::draft);
}
