// A model's decoder layers run in one call per step (decoder_stack.cpp registers the class;
// draft_chain.cpp drafts with one).
//
// Driven from Python, a layer is a dozen operator calls and each costs a few microseconds of
// interpreter and dispatch time: at batch 1 that was a quarter of a decode step on top of the
// products. DecoderStack holds the layers' stored weights (the same tensors the Python modules
// hold, not copies) with each projection's autotuned kernel per row count, and runs the layers
// in C++ with the same operators the Python fused path calls (engine/models/llama.py), so both
// paths compute the same numbers. It covers float32 activations on the CPU with every
// projection in a stored (GGUF) format and attention in one group of short query runs (decode,
// verification, batched decode); engine/models/decoder_stack.py decides when it applies.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace specserve_kernels {

// One stored weight of a projection and the kernel that multiplies it at each row count.
struct Part {
  at::Tensor codes, scales, mins, bias;  // bias undefined: none
  std::vector<int64_t> limits;           // largest row count each kernel serves, ascending
  std::vector<std::string> isas;         // "" where the plan names a product that is not a kernel

  const std::string& isa_for(int64_t rows) const {
    for (size_t i = 0; i < limits.size(); ++i)
      if (rows <= limits[i]) return isas[i];
    return isas.back();
  }
};

// A projection: its parts' outputs side by side (a fused q/k/v whose parts are stored in
// different formats has several).
struct Projection {
  std::vector<Part> parts;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
};

enum Slot : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

using ProductFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, c10::string_view);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNormFn = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluMulFn = at::Tensor(const at::Tensor&);
using RopeWriteKvFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, int64_t);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&, double, at::Tensor&);
using DequantizeRowsFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, c10::string_view);
using ChainPlanFn = std::vector<at::Tensor>(c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef,
                                            c10::IntArrayRef, int64_t, int64_t);
using StatisticsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&);
using ArgmaxFn = at::Tensor(const at::Tensor&);

// The operators of the Python fused path (and of a drafting pass: draft_chain.cpp), looked up
// once through the dispatcher.
struct Ops {
  c10::TypedOperatorHandle<ProductFn> product;
  c10::TypedOperatorHandle<ProductFn> int8_product;  // plans naming "int8-<isa>"
  c10::TypedOperatorHandle<RmsNormFn> rms_norm;
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul;
  c10::TypedOperatorHandle<RopeWriteKvFn> rope_write_kv;
  c10::TypedOperatorHandle<AttentionFn> attention;
  c10::TypedOperatorHandle<DequantizeRowsFn> dequantize_rows;
  c10::TypedOperatorHandle<ChainPlanFn> chain_plan;
  c10::TypedOperatorHandle<StatisticsFn> softmax_statistics;
  c10::TypedOperatorHandle<ArgmaxFn> row_argmax;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Ops{
          find("specserve::dequant_matmul").typed<ProductFn>(),
          find("specserve::int8_matmul").typed<ProductFn>(),
          find("specserve::rms_norm").typed<RmsNormFn>(),
          find("specserve::add_rms_norm").typed<AddRmsNormFn>(),
          find("specserve::silu_mul").typed<SiluMulFn>(),
          find("specserve::rope_write_kv").typed<RopeWriteKvFn>(),
          find("specserve::cached_attention").typed<AttentionFn>(),
          find("specserve::dequantize_rows").typed<DequantizeRowsFn>(),
          find("specserve::chain_attention_plan").typed<ChainPlanFn>(),
          find("specserve::softmax_statistics").typed<StatisticsFn>(),
          find("specserve::row_argmax").typed<ArgmaxFn>(),
      };
    }();
    return ops;
  }
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, double eps)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps) {}

  int64_t add_layer(at::Tensor input_norm, at::Tensor post_attention_norm) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), {}, {}, {}, {}});
    return int64_t(layers_.size()) - 1;
  }

  void add_part(int64_t layer, int64_t slot, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                std::optional<at::Tensor> bias, std::vector<int64_t> limits,
                std::vector<std::string> isas) {
    TORCH_CHECK(layer >= 0 && layer < int64_t(layers_.size()), "no layer ", layer);
    TORCH_CHECK(!limits.empty() && limits.size() == isas.size(), "a plan needs limits and kernels");
    Part part{std::move(codes), std::move(scales), std::move(mins),
              bias ? *bias : at::Tensor(), std::move(limits), std::move(isas)};
    projection(layers_[layer], slot).parts.push_back(std::move(part));
  }

  // Whether every projection has a kernel for this many rows (else the Python path runs).
  bool supports(int64_t rows) const {
    for (const Layer& layer : layers_)
      for (int64_t slot = kQkv; slot <= kDown; ++slot)
        for (const Part& part : projection(layer, slot).parts)
          if (part.isa_for(rows).empty()) return false;
    return true;
  }

  // Runs layers[layer_ids[i]] in order over hidden [T, hidden] (updated in place), skipping the
  // attention or MLP sublayer where attention[i] or mlp[i] is 0. kv_caches holds each layer's
  // (k, v) cache, flattened. Returns [T, captures.size() * hidden]: hidden after each layer of
  // ``captures``, side by side in that order (EAGLE-3 reads three), when any is asked for;
  // capturing inside one call saves a call and a concatenation per captured layer. With
  // ``qkv_input``, the first layer's q/k/v are projected from it rather than from the normed
  // hidden (which stays the residual).
  std::optional<at::Tensor> forward(at::Tensor hidden, const at::Tensor& rope_factors,
                                    const at::Tensor& slot_mapping, std::vector<at::Tensor> kv_caches,
                                    const at::Tensor& query_index, const at::Tensor& kv_slots,
                                    const std::optional<at::Tensor>& mask,
                                    const std::optional<at::Tensor>& valid, double scale,
                                    std::vector<int64_t> layer_ids, std::vector<int64_t> attention,
                                    std::vector<int64_t> mlp, std::vector<int64_t> captures,
                                    const std::optional<at::Tensor>& qkv_input) {
    TORCH_CHECK(kv_caches.size() == 2 * layers_.size(), "one (k, v) cache pair per layer");
    TORCH_CHECK(attention.size() == layer_ids.size() && mlp.size() == layer_ids.size(),
                "one attention and one MLP flag per layer run");
    TORCH_CHECK(hidden.is_contiguous(), "hidden must be contiguous");
    const Ops& ops = Ops::get();
    const int64_t rows = hidden.size(0);
    std::optional<at::Tensor> captured;
    const int64_t width = hidden.size(1);
    size_t filled = 0;  // captures whose layer ran
    if (!captures.empty())
      captured = at::empty({rows, int64_t(captures.size()) * width}, hidden.options());
    for (size_t i = 0; i < layer_ids.size(); ++i) {
      const int64_t id = layer_ids[i];
      TORCH_CHECK(id >= 0 && id < int64_t(layers_.size()), "no layer ", id);
      const Layer& layer = layers_[id];
      at::Tensor delta;
      if (attention[i]) {
        // The first layer's attention may read an input of its own (EAGLE-3: the normed
        // embedding and feature side by side) instead of the normed residual stream.
        const at::Tensor x = i == 0 && qkv_input.has_value()
            ? *qkv_input : ops.rms_norm.call(hidden, layer.input_norm, eps_);
        const at::Tensor qkv = run(ops, layer.qkv, x, rows);
        auto [q, k, v] = ops.rope_write_kv.call(qkv, rope_factors, slot_mapping, kv_caches[2 * id],
                                                kv_caches[2 * id + 1], num_heads_, num_kv_heads_);
        at::Tensor out = at::empty(q.sizes(), q.options());
        ops.attention.call(q, kv_caches[2 * id], kv_caches[2 * id + 1], query_index, kv_slots, mask,
                           valid, scale, out);
        delta = run(ops, layer.o, out.view({rows, -1}), rows);
      }
      if (mlp[i]) {
        const at::Tensor x = delta.defined()
            ? ops.add_rms_norm.call(hidden, delta, layer.post_attention_norm, eps_)
            : ops.rms_norm.call(hidden, layer.post_attention_norm, eps_);
        hidden.add_(run(ops, layer.down, ops.silu_mul.call(run(ops, layer.gate_up, x, rows)), rows));
      } else if (delta.defined()) {
        hidden.add_(delta);
      }
      for (size_t j = 0; j < captures.size(); ++j) {
        if (captures[j] != id) continue;
        captured->narrow(1, int64_t(j) * width, width).copy_(hidden);  // later layers update hidden
        ++filled;
      }
    }
    if (filled < captures.size()) return std::nullopt;  // a captured layer did not run
    return captured;
  }

 private:
  static Projection& projection(Layer& layer, int64_t slot) {
    return const_cast<Projection&>(projection(static_cast<const Layer&>(layer), slot));
  }
  static const Projection& projection(const Layer& layer, int64_t slot) {
    switch (slot) {
      case kQkv: return layer.qkv;
      case kO: return layer.o;
      case kGateUp: return layer.gate_up;
      case kDown: return layer.down;
      default: TORCH_CHECK(false, "no projection slot ", slot);
    }
  }

 public:
  // x [rows, in] through projection p with the kernels its plan names for that many rows.
  static at::Tensor run(const Ops& ops, const Projection& p, const at::Tensor& x, int64_t rows) {
    std::vector<at::Tensor> outs;
    outs.reserve(p.parts.size());
    for (const Part& part : p.parts) {
      // A plan naming "int8-<isa>" runs the 8-bit-activation product (int8_matmul.cpp); the
      // part then holds the weight in that product's packed layout.
      const std::string& isa = part.isa_for(rows);
      at::Tensor y = isa.rfind("int8-", 0) == 0
          ? ops.int8_product.call(x, part.codes, part.scales, part.mins, c10::string_view(isa).substr(5))
          : ops.product.call(x, part.codes, part.scales, part.mins, isa);
      if (part.bias.defined()) y.add_(part.bias);
      outs.push_back(std::move(y));
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  }

 private:
  int64_t num_heads_, num_kv_heads_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace specserve_kernels
