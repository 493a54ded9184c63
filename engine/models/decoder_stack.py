"""The decoder layers of a step in one C++ call (``engine/kernels/decoder_stack.cpp``).

At batch 1 a step's products take a few milliseconds and driving 30 layers from Python
(a dozen operator calls each) added about a quarter on top. The C++ stack runs the same
operators as ``DecoderLayer._forward_fused`` over the same weight tensors, with each
projection's autotuned kernel per row count, so a step is one call for all layers.

It applies where the fused Python path would run with kernels only: float32 on the CPU, every
projection a stored (GGUF-format) weight whose plan names a C++ kernel for the step's row
count, and attention in one group of short query runs (decode, verification, batched
decode). Anything else (prefill, dense or draft-copy weights, several attention groups) runs
the Python layers, which stay the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.attention import SHORT_QUERY_LIMIT, AttentionMetadata
from engine.kernels.build import load_kernels
from engine.models.int8_activations import packed
from engine.models.quantized_linear import QuantizedLinear, StackedLinear, plans_version

# Projection slots as decoder_stack.cpp numbers them.
_SLOTS = ("qkv", "o", "gate_up", "down")


def _parts(projection: nn.Module) -> list[QuantizedLinear] | None:
    if isinstance(projection, QuantizedLinear):
        return [projection]
    if isinstance(projection, StackedLinear) and all(
        isinstance(p, QuantizedLinear) for p in projection.parts
    ):
        return list(projection.parts)
    return None


def _kernel_plan(part: QuantizedLinear) -> tuple[list[int], list[str]]:
    """The part's plan as row limits and kernel names ("" where the product is not a kernel)."""
    limits = [rows for rows, _ in part.plan]
    isas = [
        name.removeprefix("kernel-") if name.startswith("kernel-") else "" for _, name in part.plan
    ]
    return limits, isas


def _plan_weights(part: QuantizedLinear, isas: list[str]):
    """The tensors the part's plan multiplies: the stored weight, or its packed layout for a
    plan of 8-bit-activation products (which is never mixed with exact ones)."""
    if any(isa.startswith("int8-") for isa in isas):
        if not all(isa.startswith("int8-") for isa in isas):
            raise ValueError(f"a plan mixes 8-bit-activation and exact products: {part.plan}")
        return packed(part.stored)
    w = part.stored
    return w.codes, w.scales, w.mins


def projection_parts(projection: nn.Module) -> list[tuple] | None:
    """A projection's stored parts as the C++ classes take them: (codes, scales, mins, bias,
    row limits, kernel names) each, or None where one is not a stored weight."""
    parts = _parts(projection)
    if parts is None:
        return None
    out = []
    for part in parts:
        limits, isas = _kernel_plan(part)
        out.append((*_plan_weights(part, isas), part.bias, limits, isas))
    return out


def add_layers(stack, layers: Sequence[nn.Module]) -> None:
    """Give a C++ ``DecoderStack`` (or ``DraftChain``) these layers' weights and plans."""
    for layer in layers:
        # (a first layer without an input norm reads ``qkv_input``: the norm goes unused)
        norm = layer.input_norm if layer.input_norm is not None else layer.post_attention_norm
        index = stack.add_layer(norm, layer.post_attention_norm)
        for slot, name in enumerate(_SLOTS):
            for part in projection_parts(getattr(layer, name)):
                stack.add_part(index, slot, *part)


class DecoderStack:
    """The C++ stack for one model's layers, rebuilt when autotune changes a plan."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = layers
        self._stack = None
        self._version = None
        self._supports: dict[int, bool] = {}  # row counts the built stack has kernels for
        self._kv_source = None
        self._kv_flat: list[torch.Tensor] = []
        self._all_layers = list(range(len(layers)))
        self._all_on = [1] * len(layers)

    @staticmethod
    def usable(layers: Sequence[nn.Module], entry_given: bool = False) -> bool:
        """Whether the stack can run these layers; ``entry_given``: the first layer's q/k/v
        input always comes from the caller (``run(qkv_input=...)``), so it needs no input
        norm of its own."""

        def fused(layer) -> bool:
            if entry_given and layer is layers[0] and layer.input_norm is None:
                norm = layer.post_attention_norm
                return norm.device.type == "cpu" and norm.dtype == torch.float32
            return getattr(layer, "fused_ops", False)

        return (
            len(layers) > 0
            and load_kernels()
            and all(fused(layer) for layer in layers)
            and all(_parts(getattr(layer, slot)) is not None for layer in layers for slot in _SLOTS)
        )

    def _build(self):
        arch = self.layers[0].arch
        stack = torch.classes.specserve.DecoderStack(
            arch.num_heads, arch.num_kv_heads, float(arch.rms_norm_eps)
        )
        add_layers(stack, self.layers)
        return stack

    def _flat_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        if kv_caches is not self._kv_source:  # the engine passes the same list every step
            self._kv_source = kv_caches
            # A truncated draft copy runs on the target's cache: its first layers' pairs.
            self._kv_flat = [t for pair in kv_caches[: len(self.layers)] for t in pair]
        return self._kv_flat

    def _on(self, ids: list[int]) -> list[int]:
        return self._all_on if len(ids) == len(self._all_on) else [1] * len(ids)

    def run(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        layer_ids: Sequence[int] | None,
        hidden_layer: int | tuple[int, ...] | None,
        skip_attention: frozenset[int],
        skip_mlp: frozenset[int],
        qkv_input: torch.Tensor | None = None,
    ) -> tuple[bool, torch.Tensor | None]:
        """Run the layers over ``hidden`` in place if the stack applies to this step.

        Returns (whether it ran, hidden states after ``hidden_layer`` or None); with a tuple
        of layers, their outputs side by side, [T, len(layers) * d], in that order.
        ``qkv_input`` [T, in]: what the first layer's q/k/v are projected from, instead of
        its input norm of ``hidden`` (EAGLE-3's layer)."""
        if len(attn.groups) != 1 or not isinstance(rope, torch.Tensor):
            return False, None
        group = attn.groups[0]
        if group.kv_slots is None or group.query_index.shape[1] > SHORT_QUERY_LIMIT:
            return False, None
        if self._version != plans_version():
            self._stack, self._version = self._build(), plans_version()
            self._supports = {}
        rows = hidden.shape[0]
        if rows not in self._supports:  # a call into the TorchScript class: 30 us in a step
            self._supports[rows] = self._stack.supports(rows)
        if not self._supports[rows]:
            return False, None
        ids = self._all_layers if layer_ids is None else list(layer_ids)
        captured = self._stack.forward(
            hidden,
            torch.view_as_real(rope),
            attn.slot_mapping,
            self._flat_caches(kv_caches),
            group.query_index,
            group.kv_slots,
            group.mask,
            group.valid,
            attn.scale,
            ids,
            [int(i not in skip_attention) for i in ids] if skip_attention else self._on(ids),
            [int(i not in skip_mlp) for i in ids] if skip_mlp else self._on(ids),
            _captures(hidden_layer),
            qkv_input,
        )
        return True, captured


def _captures(hidden_layer: int | tuple[int, ...] | None) -> list[int]:
    if hidden_layer is None:
        return []
    return [hidden_layer] if isinstance(hidden_layer, int) else list(hidden_layer)
