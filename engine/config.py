"""Typed engine configuration, loaded from YAML (see configs/default.yaml).

Unknown keys are errors that name the key: a typo in a config must not silently fall
back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KVCacheConfig(_Strict):
    block_size: int = Field(16, ge=1)
    # Exactly sized when set; otherwise sized from ``memory_gib`` on the CPU and from
    # ``gpu_memory_utilization`` on a GPU.
    num_blocks: int | None = Field(None, ge=1)
    memory_gib: float = Field(1.0, gt=0)
    # On a GPU (vLLM's meaning): the share of the device's whole memory this engine may hold,
    # weights and activations included; the KV cache gets what the loaded model leaves of it.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    # None: the model's max_position_embeddings.
    max_model_len: int | None = Field(None, ge=2)


DecoderName = Literal[
    "autoregressive",
    "ngram",
    "draft",
    "layerskip",
    "hierarchical",
    "medusa",
    "hydra",
    "eagle",
    "kangaroo",
]


class DraftModelConfig(_Strict):
    """The ``draft`` decoder's model: a separate model sharing the target's tokenizer, or
    ``"self"``, a cheaper copy of the target (see ``quantization`` and ``num_layers``)."""

    model: str = "self"  # "self", or any model the loader takes (name, directory, .gguf, hub id)
    # Weight-only precision of the draft's projections: int8 (per channel), int4 (per group of
    # 32 inputs), bfloat16, or none.
    quantization: Literal["none", "bfloat16", "int8", "int4"] = "int8"
    # Keep only the first N layers (then the final norm and LM head); None keeps all.
    num_layers: int | None = Field(None, ge=1)


class TrainedDrafterConfig(_Strict):
    """A trained decoder's drafter (``medusa``, ``hydra``, ``eagle``, ``kangaroo``): a
    directory that ``specserve train KIND`` writes (None takes the drafter shipped for the
    model, if one is), and the precision its own projections run at: int8 weights (per
    channel; a quarter of float32's bytes per draft) or unquantized in the model's dtype
    (none: float32 on the CPU). Drafts only set the speed: output is exact either way."""

    drafter: str | None = None
    quantization: Literal["none", "int8"] = "int8"


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


class LayerSkipConfig(_Strict):
    """The ``layerskip`` draft: the target with sublayers skipped (Draft & Verify) or cut
    after ``exit_layer`` (LayerSkip's early exit). ``specserve tune layerskip`` fills these."""

    skip_attention: list[int] = Field(default_factory=list)
    skip_mlp: list[int] = Field(default_factory=list)
    exit_layer: int | None = Field(None, ge=0)


class WindowConfig(_Strict):
    """How many tokens a drafter drafts, up to k: all of them (fixed); until the draft's top-1
    probability falls below gamma, with gamma adapted after each verification (adaptive_exit,
    Draft & Verify); until the draft's entropy exceeds tau, tau tracking the mean entropy of
    rejected drafts (entropy, HSDDW)."""

    policy: Literal["fixed", "adaptive_exit", "entropy"] = "fixed"
    gamma: float = Field(0.6, ge=0, le=1)  # adaptive_exit: initial threshold
    target_acceptance: float = Field(0.8, gt=0, lt=1)  # adaptive_exit: the rate gamma steers to
    step: float = Field(0.01, gt=0, le=0.5)  # adaptive_exit: epsilon
    acceptance_smoothing: float = Field(0.5, ge=0, lt=1)  # adaptive_exit: beta1
    gamma_smoothing: float = Field(0.9, ge=0, lt=1)  # adaptive_exit: beta2
    tau: float = Field(2.0, gt=0)  # entropy: initial threshold, nats


class GateConfig(_Strict):
    """Target-confidence gating: no drafts for a sequence while the target's probability for
    its last emitted token is below ``min_target_prob`` (None: never gated)."""

    min_target_prob: float | None = Field(None, gt=0, lt=1)


class HierarchicalConfig(_Strict):
    """HSDDW's three levels: ``level1`` drafts for the ``draft`` model (level 2), which
    verifies and extends while its entropy stays below ``tau2``; the target verifies last."""

    level1: Literal["ngram", "draft_truncated"] = "ngram"
    level1_num_layers: int = Field(4, ge=1)  # draft_truncated: layers of the level-2 model kept
    tau2: float = Field(1.0, gt=0)


class DecoderConfig(_Strict):
    # The decoder of requests that do not pick one.
    method: DecoderName = "autoregressive"
    # Further decoders loaded alongside, for requests that pick one ("speculative").
    extra_methods: list[DecoderName] = Field(default_factory=list)
    # Draft tokens per step (k): the most a drafting decoder proposes for one sequence.
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # How many of those k to draft each step: the goodput policy's choice, 0 included, from
    # measured step costs and acceptance (engine/draft_policy.py), or "fixed": always k
    # (capped by windows and the gate, as the policy is).
    draft_policy: Literal["fixed", "goodput"] = "goodput"
    # The goodput policy's bound on inter-token latency: a drafting step may take at most this
    # many times a plain step's predicted time (1.1: chunks come at most 10% further apart than
    # without drafting). None: the length with the most tokens per second, however long its
    # step. On a 2-core CPU, where one draft makes a step 1.2-1.3x, 1.1 keeps a single stream
    # plain; cheap drafts verified where a few more tokens cost little (a GPU) can fit it.
    max_step_stretch: float | None = Field(None, ge=1.0)
    # Also load the trained drafters that ship for the model (engine/drafters/), so that a
    # request can pick medusa, hydra, eagle or kangaroo without training one first. Loaded
    # but unused, they cost memory only: a step runs plain unless a sequence drafts.
    load_shipped_drafters: bool = True
    # ngram: the longest and shortest suffix n-gram looked up in the prompt and output.
    prompt_lookup_max: int = Field(4, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    # ngram: earlier matches whose continuations are merged into a token tree (1: a chain).
    prompt_lookup_candidates: int = Field(1, ge=1, le=16)
    draft: DraftModelConfig = Field(default_factory=DraftModelConfig)
    layerskip: LayerSkipConfig = Field(default_factory=LayerSkipConfig)
    hierarchical: HierarchicalConfig = Field(default_factory=HierarchicalConfig)
    medusa: TrainedDrafterConfig = Field(default_factory=TrainedDrafterConfig)
    hydra: TrainedDrafterConfig = Field(default_factory=TrainedDrafterConfig)
    eagle: EagleConfig = Field(default_factory=EagleConfig)
    kangaroo: KangarooConfig = Field(default_factory=KangarooConfig)
    window: WindowConfig = Field(default_factory=WindowConfig)
    gate: GateConfig = Field(default_factory=GateConfig)

    @model_validator(mode="after")
    def _drafts_are_cheaper_than_the_target(self) -> DecoderConfig:
        draft = self.draft
        uses_draft = {"draft", "hierarchical"} & set(self.methods)
        if uses_draft and draft.model == "self" and draft.quantization == "none":
            if draft.num_layers is None:
                raise ValueError(
                    "draft.model 'self' with quantization 'none' and no num_layers is the "
                    "target itself: pick a quantization (int8, int4, bfloat16) or num_layers"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self

    @model_validator(mode="after")
    def _layerskip_has_a_draft(self) -> DecoderConfig:
        skip = self.layerskip
        if "layerskip" in self.methods and not (
            skip.skip_attention or skip.skip_mlp or skip.exit_layer is not None
        ):
            raise ValueError(
                "layerskip needs layerskip.skip_attention, skip_mlp or exit_layer (without "
                "them the draft is the target itself); `specserve tune layerskip` searches them"
            )
        return self

    @property
    def methods(self) -> list[str]:
        """Every loaded decoder, the default first, each once."""
        return list(dict.fromkeys([self.method, *self.extra_methods]))


class EngineConfig(_Strict):
    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "cpu", or a CUDA device ("cuda", "cuda:1"): the whole engine (weights, KV cache,
    # sampling) runs there.
    device: str = "cpu"
    # On a GPU: run every step eagerly instead of replaying CUDA graphs of decode and
    # verification steps (vLLM's flag; for debugging and for comparing the two).
    enforce_eager: bool = False
    # Threads of the products. None (auto): every core while the cores are free, one fewer per
    # core other processes keep busy (engine/thread_governor.py). A number fixes it.
    num_threads: int | None = Field(None, ge=1)
    # Words and phrases no output contains, on top of each request's own (whole words, any
    # casing; engine/constraints/banned.py says exactly what is guaranteed).
    banned_words: list[str] = Field(default_factory=list)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        kind, colon, index = device.partition(":")
        numbered = kind == "cuda" and index.isdigit()
        if kind not in ("cpu", "cuda") or (colon and not numbered):
            raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
        return device

    @field_validator("banned_words")
    @classmethod
    def _phrases_with_words(cls, words: list[str]) -> list[str]:
        # As a request's: a phrase without a letter or digit ("", "...") would match at
        # every word boundary and rewind every request until it gives up.
        empty = [w for w in words if not any(map(str.isalnum, w))]
        if empty:
            raise ValueError(f"banned_words {empty!r}: each needs at least one letter or digit")
        return words

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(_describe(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        # One file configures a whole server: its `server:` section (CORS) is the HTTP
        # server's to read, not the engine's.
        data = {k: v for k, v in data.items() if k != "server"}
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with top-level or nested (dict) fields replaced, validated again."""
        data = self.model_dump()
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return EngineConfig.from_dict(data)


def _describe(error: ValidationError) -> str:
    messages = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            messages.append(f"unknown config key {key!r}")
        else:
            messages.append(f"config key {key!r}: {item['msg']}")
    return "; ".join(messages)
