"""Every speculative decoder, registered once: its name, its config section, how to build it,
whether it reads a trained drafter, and the variants the bench measures.

Config validation, the command line's choices, the engine's builder, training, the server's
``speculative.method`` check and the bench all read this table, so a new decoder is one file
(its ``build`` function) plus one ``register`` call here. The table imports no torch: the
builders are named as ``"module:function"`` and imported only when an engine builds one, so
the API process can validate configs and requests against it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """A config section: unknown keys are errors that name the key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---- decoder config sections -------------------------------------------------------------


class DraftModelConfig(Strict):
    """The ``draft`` decoder's model: a separate model sharing the target's tokenizer, or
    ``"self"``, a cheaper copy of the target (see ``quantization`` and ``num_layers``)."""

    model: str = "self"  # "self", or any model the loader takes (name, directory, .gguf, hub id)
    # Weight-only precision of the draft's projections: int8 (per channel), int4 (per group of
    # 32 inputs), bfloat16, or none.
    quantization: Literal["none", "bfloat16", "int8", "int4"] = "int8"
    # Keep only the first N layers (then the final norm and LM head); None keeps all.
    num_layers: int | None = Field(None, ge=1)


class TrainedDrafterConfig(Strict):
    """A trained decoder's drafter (``medusa``, ``hydra``, ``eagle``, ``kangaroo``): a
    directory that ``specserve train KIND`` writes (None takes the drafter shipped for the
    model, if one is), and the precision its own projections (and its rows of the LM head)
    run at: int8 weights (per channel; a quarter of float32's bytes per draft), int4 (per
    group of 32 inputs, the target's own kernels: about half int8's bytes, and on a CPU a
    draft reads its weights from memory as the target's step does) or unquantized in the
    model's dtype (none: float32 on the CPU). Drafts only set the speed: output is exact
    either way."""

    drafter: str | None = None
    quantization: Literal["none", "int8", "int4"] = "int8"


class EagleConfig(TrainedDrafterConfig):
    """The ``eagle`` decoder's drafter; with ``tree_top_k`` > 0 it drafts EAGLE-2's dynamic
    trees (each depth expands the ``tree_top_k`` most likely nodes with ``tree_top_k``
    children each, at most ``tree_depth`` deep; the step's k is the tree's node count), else
    chains."""

    tree_top_k: int = Field(0, ge=0, le=16)
    tree_depth: int = Field(4, ge=1, le=16)


class KangarooConfig(TrainedDrafterConfig):
    """The ``kangaroo`` decoder's adapter (its exit layer is part of the trained drafter), the
    precision of the adapter's projections, and the second early exit: drafting stops once
    the drafter's top-1 probability falls below ``exit_threshold`` (Kangaroo's eta)."""

    exit_threshold: float = Field(0.6, ge=0, le=1)


class LayerSkipConfig(Strict):
    """The ``layerskip`` draft: the target with sublayers skipped (Draft & Verify) or cut
    after ``exit_layer`` (LayerSkip's early exit). ``specserve tune layerskip`` fills these."""

    skip_attention: list[int] = Field(default_factory=list)
    skip_mlp: list[int] = Field(default_factory=list)
    exit_layer: int | None = Field(None, ge=0)


class HierarchicalConfig(Strict):
    """HSDDW's three levels: ``level1`` drafts for the ``draft`` model (level 2), which
    verifies and extends while its entropy stays below ``tau2``; the target verifies last."""

    level1: Literal["ngram", "draft_truncated"] = "ngram"
    level1_num_layers: int = Field(4, ge=1)  # draft_truncated: layers of the level-2 model kept
    tau2: float = Field(1.0, gt=0)


class HybridConfig(Strict):
    """The ``hybrid`` decoder: prompt lookup where a match of at least ``lookup_min`` tokens
    is found (up to ``prompt_lookup_max``), else the trained decoder ``drafter`` (configured
    by its own section), drafting at most ``drafter_max_tokens`` (None: k) a step."""

    drafter: str = "hydra"
    lookup_min: int = Field(3, ge=1)
    drafter_max_tokens: int | None = Field(None, ge=1)

    @field_validator("drafter")
    @classmethod
    def _a_trained_decoder(cls, name: str) -> str:
        if name not in trained_decoders():
            raise ValueError(f"hybrid.drafter must be one of {', '.join(trained_decoders())}")
        return name


# ---- the registry ------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder. ``build`` is ``"module:function"``, called as ``function(decoder_config,
    target_context)``; ``section`` is the config class of its ``decoder.<name>`` section
    (None: it has none, or shares another's); ``trained``: it reads a drafter that ``specserve
    train <name>`` writes (and one may ship for a model); ``check(decoder_config)`` raises
    ValueError on a config it cannot run; ``bench``: variant name -> decoder overrides."""

    name: str
    build: str | None
    summary: str
    section: type[Strict] | None = None
    trained: bool = False
    network: str | None = None  # a trained decoder's drafter network, "module:Class"
    check: Callable[[Any], None] | None = None
    bench: dict[str, dict] = field(default_factory=dict)
    drafts_with: Callable[[Any], str] | None = None

    def builder(self) -> Callable:
        return _imported(self.build)

    def network_class(self) -> type:
        return _imported(self.network)


def _imported(name: str):
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


DECODERS: dict[str, DecoderSpec] = {}


def register(spec: DecoderSpec) -> DecoderSpec:
    if spec.name in DECODERS:
        raise ValueError(f"decoder {spec.name!r} is registered twice")
    DECODERS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registration (tests that register a toy decoder clean up with it)."""
    DECODERS.pop(name, None)


def decoder_spec(name: str) -> DecoderSpec:
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; known: {', '.join(DECODERS)}")
    return DECODERS[name]


def trained_decoders() -> list[str]:
    return [name for name, spec in DECODERS.items() if spec.trained]


def decoders_on_drafters(config) -> dict[str, str]:
    """Decoder name -> the trained decoder whose drafter it drafts with, for ``config``."""
    return {
        name: spec.drafts_with(config)
        for name, spec in DECODERS.items()
        if spec.drafts_with is not None
    }


def _draft_is_cheaper_than_the_target(config) -> None:
    draft = config.draft
    if draft.model == "self" and draft.quantization == "none" and draft.num_layers is None:
        raise ValueError(
            "draft.model 'self' with quantization 'none' and no num_layers is the "
            "target itself: pick a quantization (int8, int4, bfloat16) or num_layers"
        )


def _layerskip_has_a_draft(config) -> None:
    skip = config.layerskip
    if not (skip.skip_attention or skip.skip_mlp or skip.exit_layer is not None):
        raise ValueError(
            "layerskip needs layerskip.skip_attention, skip_mlp or exit_layer (without "
            "them the draft is the target itself); `specserve tune layerskip` searches them"
        )


def _k(name: str, *ks: int) -> dict[str, dict]:
    """Bench variants of ``name`` at draft lengths ``ks``."""
    return {f"{name}-k{k}": {"method": name, "num_speculative_tokens": k} for k in ks}


def _goodput(name: str, untrimmed: bool = False) -> dict[str, dict]:
    """The policy's variant; with ``untrimmed`` also the policy verifying every draft it has
    drafted (the chance floor's A/B, for drafters whose chains carry probabilities)."""
    variants = {f"{name}-goodput": {"method": name, "draft_policy": "goodput"}}
    if untrimmed:
        variants[f"{name}-goodput-untrimmed"] = {
            "method": name, "draft_policy": "goodput", "trim_unlikely_drafts": False
        }  # fmt: skip
    return variants


def _hybrid_k1(variant: str, **hybrid) -> dict[str, dict]:
    """A fixed hybrid: lookup drafts up to k, the trained drafter one token (unless
    ``drafter_max_tokens`` says more)."""
    section = {"drafter_max_tokens": 1, **hybrid}
    return {variant: {"method": "hybrid", "draft_policy": "fixed", "hybrid": section}}


def _draft(quantization: str = "int8", layers: int | None = None, **extra) -> dict:
    spec = {"model": "self", "quantization": quantization, "num_layers": layers}
    return {"method": "draft", "draft": spec, **extra}


register(DecoderSpec("autoregressive", None, "plain decoding: one token a step, no drafts"))
register(
    DecoderSpec(
        "ngram",
        "engine.decoders.ngram:build_ngram_decoder",
        "prompt lookup: drafts copied from earlier text that ends like the current text",
        bench={
            "ngram": {"method": "ngram"},
            "ngram-tree4": {"method": "ngram", "prompt_lookup_candidates": 4},
            "ngram-tree4-k8": {
                "method": "ngram", "prompt_lookup_candidates": 4, "num_speculative_tokens": 8,
            },
            **_goodput("ngram"),
        },
    )  # fmt: skip
)
register(
    DecoderSpec(
        "draft",
        "engine.decoders.draft:build_draft_decoder",
        "a draft model (a separate small model, or a cheaper copy of the target) drafts a chain",
        section=DraftModelConfig,
        check=_draft_is_cheaper_than_the_target,
        bench={
            "draft-int8": _draft(),
            "draft-int4": _draft("int4"),
            "draft-bf16": _draft("bfloat16"),
            "draft-int8-adaptive": _draft(window={"policy": "adaptive_exit"}),
            "draft-int8-entropy": _draft(window={"policy": "entropy"}),
            "draft-int8-gate0.3": _draft(gate={"min_target_prob": 0.3}),
        },
    )
)
register(
    DecoderSpec(
        "layerskip",
        "engine.decoders.layerskip:build_layerskip_decoder",
        "the target with layers skipped or cut early drafts for itself (Draft & Verify, LayerSkip)",
        section=LayerSkipConfig,
        check=_layerskip_has_a_draft,
    )
)
register(
    DecoderSpec(
        "hierarchical",
        "engine.decoders.hierarchical:build_hierarchical_decoder",
        "HSDDW: n-grams draft for the draft model, which drafts for the target",
        section=HierarchicalConfig,
        check=_draft_is_cheaper_than_the_target,
        bench={"hierarchical": {**_draft(), "method": "hierarchical", "hierarchical": {}}},
    )
)
register(
    DecoderSpec(
        "medusa",
        "engine.decoders.medusa:build_medusa_decoder",
        "Medusa: trained heads guess the next tokens from the target's hidden state (a tree)",
        section=TrainedDrafterConfig,
        trained=True,
        network="engine.decoders.medusa:MedusaHeads",
        bench={"medusa": {"method": "medusa"}, **_k("medusa", 1), **_goodput("medusa")},
    )
)
register(
    DecoderSpec(
        "hydra",
        "engine.decoders.hydra:build_hydra_decoder",
        "Hydra: sequentially dependent trained heads (a tree)",
        section=TrainedDrafterConfig,
        trained=True,
        network="engine.decoders.hydra:HydraHeads",
        bench={
            "hydra": {"method": "hydra"}, **_k("hydra", 1, 2, 8),
            "hydra-k1-int4": {
                "method": "hydra", "num_speculative_tokens": 1, "hydra": {"quantization": "int4"}
            },
            **_goodput("hydra", untrimmed=True),
        },  # fmt: skip
    )
)
register(
    DecoderSpec(
        "eagle",
        "engine.decoders.eagle:build_eagle_decoder",
        "EAGLE: a one-layer drafter over the target's features (chains, or EAGLE-2's trees)",
        section=EagleConfig,
        trained=True,
        network="engine.decoders.eagle:EagleNetwork",
        bench={
            "eagle": {"method": "eagle"},
            **_k("eagle", 1, 2, 3),
            "eagle-tree2": {"method": "eagle", "eagle": {"tree_top_k": 2}},
            "eagle-tree4-k8": {
                "method": "eagle", "eagle": {"tree_top_k": 4}, "num_speculative_tokens": 8,
            },
            **_goodput("eagle"),
        },
    )  # fmt: skip
)
register(
    DecoderSpec(
        "eagle3",
        "engine.decoders.eagle3:build_eagle3_decoder",
        "EAGLE-3: EAGLE's layer over a low, a middle and a high target layer, its own head",
        section=EagleConfig,
        trained=True,
        network="engine.decoders.eagle3:Eagle3Network",
        bench={
            "eagle3": {"method": "eagle3"},
            **_k("eagle3", 1, 2, 3),
            "eagle3-k1-int4": {
                "method": "eagle3", "num_speculative_tokens": 1,
                "eagle3": {"quantization": "int4"},
            },
            "eagle3-tree2": {"method": "eagle3", "eagle3": {"tree_top_k": 2}},
            # Two drafter passes: the top 3 first drafts and their likeliest continuations,
            # the best k of them verified (where a few more verified rows are nearly free).
            **{f"eagle3-tree3-d2-k{k}": {
                "method": "eagle3", "num_speculative_tokens": k,
                "eagle3": {"tree_top_k": 3, "tree_depth": 2},
            } for k in (2, 3, 4)},
            **_goodput("eagle3", untrimmed=True),
        },
    )  # fmt: skip
)
register(
    DecoderSpec(
        "kangaroo",
        "engine.decoders.kangaroo:build_kangaroo_decoder",
        "Kangaroo: the target's first layers and a trained adapter draft, with an early exit",
        section=KangarooConfig,
        trained=True,
        network="engine.decoders.kangaroo:KangarooAdapter",
        bench={"kangaroo": {"method": "kangaroo"}, **_k("kangaroo", 1, 2), **_goodput("kangaroo")},
    )
)
register(
    DecoderSpec(
        "hybrid",
        "engine.decoders.hybrid:build_hybrid_decoder",
        "prompt lookup where the text repeats, a trained drafter elsewhere (each its own k)",
        section=HybridConfig,
        drafts_with=lambda config: config.hybrid.drafter,
        bench={
            "hybrid": {"method": "hybrid"},
            **_hybrid_k1("hybrid-k1"),
            **_hybrid_k1("hybrid-k1-min2", lookup_min=2),
            **_hybrid_k1("hybrid-eagle3-k1", drafter="eagle3"),
            # Two drafter tokens where verifying a row more is nearly free (8-bit activations).
            **_hybrid_k1("hybrid-k2", drafter_max_tokens=2),
            **_hybrid_k1("hybrid-eagle3-k2", drafter="eagle3", drafter_max_tokens=2),
            **_goodput("hybrid", untrimmed=True),
            "hybrid-goodput-k8": {
                "method": "hybrid", "draft_policy": "goodput", "num_speculative_tokens": 8,
            },
            "hybrid-eagle3-goodput": {
                "method": "hybrid", "draft_policy": "goodput", "hybrid": {"drafter": "eagle3"},
            },
        },
    )  # fmt: skip
)
