"""Typed engine configuration, loaded from YAML (see configs/default.yaml).

Unknown keys are errors that name the key: a typo in a config must not silently fall
back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KVCacheConfig(_Strict):
    block_size: int = Field(16, ge=1)
    # Exactly sized when set; otherwise sized from ``memory_gib``.
    num_blocks: int | None = Field(None, ge=1)
    memory_gib: float = Field(1.0, gt=0)
    enable_prefix_caching: bool = True


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    # None: the model's max_position_embeddings.
    max_model_len: int | None = Field(None, ge=2)


class DecoderConfig(_Strict):
    method: Literal["autoregressive", "ngram"] = "autoregressive"
    # Draft tokens per step (k): the most a drafting decoder proposes for one sequence.
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # ngram: the longest and shortest suffix n-gram looked up in the prompt and output.
    prompt_lookup_max: int = Field(4, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)


class EngineConfig(_Strict):
    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # torch intra-op threads; None keeps torch's default (one per core).
    num_threads: int | None = Field(None, ge=1)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)

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
