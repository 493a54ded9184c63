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

from engine.decoder_registry import DECODERS, decoder_spec
from engine.decoder_registry import Strict as _Strict


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


class DecoderConfig(_Strict):
    """The decoders an engine loads and what they share; each registered decoder with a
    config section has it here under its own name (``decoder.eagle``, ...), validated by the
    section's class (engine/decoder_registry.py)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    # The decoder of requests that do not pick one.
    method: str = "autoregressive"
    # Further decoders loaded alongside, for requests that pick one ("speculative").
    extra_methods: list[str] = Field(default_factory=list)
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
    # The goodput policy verifies a greedy chain's drafts only while their chance of standing
    # (the drafter's top-1 probabilities multiplied along the chain) pays for the verification
    # row at the measured step costs (engine/draft_policy.py, "chance_floor"). False: verify
    # everything drafted (the A/B's other side).
    trim_unlikely_drafts: bool = True
    # Also load the trained drafters that ship for the model (engine/drafters/), so that a
    # request can pick medusa, hydra, eagle, eagle3 or kangaroo without training one first. Loaded
    # but unused, they cost memory only: a step runs plain unless a sequence drafts.
    load_shipped_drafters: bool = True
    # ngram: the longest and shortest suffix n-gram looked up in the prompt and output.
    prompt_lookup_max: int = Field(4, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    # ngram: earlier matches whose continuations are merged into a token tree (1: a chain).
    prompt_lookup_candidates: int = Field(1, ge=1, le=16)
    window: WindowConfig = Field(default_factory=WindowConfig)
    gate: GateConfig = Field(default_factory=GateConfig)

    @model_validator(mode="before")
    @classmethod
    def _registered_sections(cls, data: Any) -> Any:
        """Each registered decoder's section, validated by its class (defaults when absent);
        any other key is unknown."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        sections = {name: s.section for name, s in DECODERS.items() if s.section is not None}
        errors = [
            {"type": "extra_forbidden", "loc": (key,), "input": data[key]}
            for key in data
            if key not in cls.model_fields and key not in sections
        ]
        for name, section in sections.items():
            value = data.get(name, {})
            if isinstance(value, BaseModel):
                value = value.model_dump()
            try:
                data[name] = section.model_validate(value)
            except ValidationError as e:
                errors += [_nested(name, error) for error in e.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        decoder_spec(method)  # ValueError naming the known ones
        return method

    @field_validator("extra_methods")
    @classmethod
    def _known_methods(cls, methods: list[str]) -> list[str]:
        for method in methods:
            decoder_spec(method)
        return methods

    @model_validator(mode="after")
    def _runnable(self) -> DecoderConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        for method in self.methods:
            check = DECODERS[method].check
            if check is not None:
                check(self)
        return self

    @property
    def methods(self) -> list[str]:
        """Every loaded decoder, the default first, each once."""
        return list(dict.fromkeys([self.method, *self.extra_methods]))

    def section(self, name: str):
        """The config section of decoder ``name``."""
        return getattr(self, name)


def _nested(name: str, error: dict) -> dict:
    """A section's validation error, located under the section."""
    nested = {"type": error["type"], "loc": (name, *error["loc"]), "input": error["input"]}
    if error.get("ctx"):
        nested["ctx"] = error["ctx"]
    return nested


class EngineConfig(_Strict):
    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "cpu", or a CUDA device ("cuda", "cuda:1"): the whole engine (weights, KV cache,
    # sampling) runs there.
    device: str = "cpu"
    # On a GPU: run every step eagerly instead of replaying CUDA graphs of decode and
    # verification steps (vLLM's flag; for debugging and for comparing the two).
    enforce_eager: bool = False
    # Every row's logits independent of the rest of its step (batch mates, verification width,
    # prefill chunks): speculative decoding then equals plain decoding bit for bit, not only
    # where no two logits lie within rounding of each other. Float32 on the CPU; costs speed
    # where the fastest products are not invariant (engine/batch_invariance.py).
    batch_invariant: bool = False
    # llama.cpp's CPU numerics, an opt-in: each row of activations rounded to 8 bits in blocks
    # of 32 before a stored weight's product, which then runs on integer dot products (AVX-512
    # VNNI or AVX2; a slow portable path elsewhere). A slightly different model from the exact
    # float32 one, and much faster where the exact products are bound by dequantizing; verification
    # rows cost little more than a decode row. Turns batch_invariant on: 8-bit rounding would
    # turn a last-bit difference between a decode and a verification pass into another code
    # (engine/models/int8_activations.py).
    int8_activations: bool = False
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
