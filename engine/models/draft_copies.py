"""Cheaper copies of a target model, to draft for it ("self" drafts).

A copy shares the target's embeddings, norms and rope, and either holds its projections at a
lower weight precision (int8, int4 or bfloat16), or keeps only its first layers, or both.
Weight reads bound a decode step, so halving or quartering the bytes read is what can make a
copy cheap enough to draft; docs/benchmarks.md has what each one pays.

Where the target runs the C++ kernels (float32 on the CPU), the copy's projections are stored
weights in the kernels' layouts (``engine.models.draft_quantization``): the copy then multiplies
with the same autotuned kernels and runs its layers through the decoder stack. Elsewhere the
PyTorch layers below hold them (int8 per output channel, int4 per group of 32 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.autotune import autotune
from engine.models.draft_quantization import STORED_QUANTIZERS, quantize_int8
from engine.models.int8_activations import int8_isas
from engine.models.int8_activations import unsupported_reason as int8_unsupported
from engine.models.linear import ONEDNN_BATCH_HINT, Linear, dense_weight
from engine.models.llama import DecoderLayer, LlamaModel
from engine.models.quantized_linear import QuantizedLinear


class Int8Linear(nn.Module):
    """Weight-only int8 with one float scale per output channel; activations stay float.

    On the CPU torch's ``_weight_int8pack_mm`` runs the product from the int8 weights with
    bfloat16 activations (what gpt-fast uses); elsewhere the weights are dequantized per call.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127
        self.weight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)
        self.bias = bias
        self.nbytes = self.weight.numel() + self.scale.numel() * 2
        self._fused = w.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            y = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16).contiguous(), self.weight, self.scale
            ).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype)[:, None])
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Weight-only int4, asymmetric, one scale and zero per group of ``group`` inputs.

    On the CPU torch's ``_weight_int4pack_mm_for_cpu`` runs the product from packed nibbles with
    bfloat16 activations; elsewhere the weights are dequantized per call.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = 32):
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4 needs in_features divisible by {group}, got {in_features}")
        grouped = weight.float().reshape(out_features, in_features // group, group)
        low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        scale = (high - low).clamp_min(1e-8) / 15
        codes = ((grouped - low) / scale).round().clamp(0, 15)
        # torch's kernels dequantize as (code - 8) * scale + zero.
        zero = low + 8 * scale
        self.group = group
        self.bias = bias
        self._fused = weight.device.type == "cpu" and hasattr(
            torch.ops.aten, "_weight_int4pack_mm_for_cpu"
        )
        if self._fused:
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.reshape(out_features, in_features).to(torch.int32), 1
            )
            self.scale_zero = (
                torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)
                .transpose(0, 1)
                .contiguous()
                .to(torch.bfloat16)
            )
        else:
            self.weight = (codes * scale + low).reshape(out_features, in_features)
        self.nbytes = out_features * in_features // 2 + 4 * out_features * in_features // group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16).contiguous(), self.weight, self.group, self.scale_zero
            ).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        return y if self.bias is None else y + self.bias


class BFloat16Linear(nn.Module):
    """bfloat16 weights (oneDNN-packed on the CPU), float activations in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.to(torch.bfloat16)
        self.packed = w.device.type == "cpu" and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        if self.packed:
            w = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        self.weight = w
        self.bias = bias
        self.nbytes = weight.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(xb, self.weight, None, "none", [], "")
        else:
            y = F.linear(xb, self.weight)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


QUANTIZERS = {"int8": Int8Linear, "int4": Int4Linear, "bfloat16": BFloat16Linear}


def _quantized(linear: Linear, quantization: str, stored: bool, int8: bool = False) -> nn.Module:
    if quantization == "none":
        return linear
    return _quantize_weight(dense_weight(linear), linear.bias, quantization, stored, int8)


def _quantize_weight(
    weight, bias, quantization: str, stored: bool, int8: bool = False
) -> nn.Module:
    """``int8``: the target takes 8-bit activations, so 8-bit codes come in its products'
    blocks of 32 where the shape allows."""
    if stored and quantization == "int8" and int8 and weight.shape[1] % 32 == 0:
        return QuantizedLinear(quantize_int8(weight, block=32), bias)
    if stored and not (quantization == "int8" and weight.shape[1] % 16):
        return QuantizedLinear(STORED_QUANTIZERS[quantization](weight), bias)
    return QUANTIZERS[quantization](weight, bias)


def use_int8_products(module: nn.Module) -> int:
    """Every stored-weight product of ``module`` that can take 8-bit activations runs them: a
    drafter of a target that does (its drafts then cost what the target's rows cost; drafts
    never change the output). Returns how many products changed."""
    isas = int8_isas()
    changed = 0
    for layer in module.modules():
        if isas and isinstance(layer, QuantizedLinear) and int8_unsupported(layer.stored) is None:
            layer.set_plan([(1 << 62, f"kernel-int8-{isas[0]}")])
            changed += 1
    return changed


def runs_kernels(target: LlamaModel) -> bool:
    """Whether ``target``'s layers run the C++ kernels (their float32 CPU path)."""
    return all(getattr(layer, "fused_ops", False) for layer in target.layers)


def quantized_dense(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, target: LlamaModel
) -> nn.Module:
    """A linear of a dense ``weight`` at ``quantization`` precision (int8, int4, bfloat16), in
    the kernels' stored layout where ``target`` runs them (autotuned), for a drafter's own
    projections."""
    int8 = target.int8_activations
    module = _quantize_weight(weight, bias, quantization, runs_kernels(target), int8)
    autotune(module)
    if int8:
        use_int8_products(module)
    return module


def draft_copy(target: LlamaModel, quantization: str = "int8", num_layers: int | None = None):
    """A copy of ``target`` with its first ``num_layers`` layers (all if None) and its
    projections and LM head at ``quantization`` precision ("none", "bfloat16", "int8" or
    "int4").

    The copy has the target's layer shapes, so it can read and write the target's KV cache.
    """
    keep = target.arch.num_layers if num_layers is None else num_layers
    if not 1 <= keep <= target.arch.num_layers:
        raise ValueError(f"num_layers must be in [1, {target.arch.num_layers}], got {num_layers}")
    stored = runs_kernels(target)  # then stored layouts, for the same kernels
    int8 = target.int8_activations
    layers = [
        DecoderLayer(
            target.arch,
            layer.input_norm,
            _quantized(layer.qkv, quantization, stored, int8),
            _quantized(layer.o, quantization, stored, int8),
            layer.post_attention_norm,
            _quantized(layer.gate_up, quantization, stored, int8),
            _quantized(layer.down, quantization, stored, int8),
        )
        for layer in list(target.layers)[:keep]
    ]
    copy = LlamaModel(
        target.arch,
        target.rope,
        target.embed_tokens,
        layers,
        target.final_norm,
        _quantized(target.lm_head, quantization, stored, int8),
    )
    autotune(copy)  # plans for its stored weights (cached per shape, shared with the target's)
    if int8:
        use_int8_products(copy)
    return copy
