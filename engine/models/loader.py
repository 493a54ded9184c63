"""Load a Hugging Face Llama-family checkpoint (a local directory) into ``LlamaModel``.

transformers supplies the config; tensors are read with safetensors and re-laid-out once
at load time (q/k/v and gate/up fused, projections prepacked where that is faster).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.linear import Linear
from engine.models.llama import DecoderLayer, LlamaModel, ModelArchitecture
from engine.models.rope import RotaryEmbedding, interleave_rope_rows

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device | str, max_positions: int | None
) -> tuple[LlamaModel, object]:
    """Build our model from a local HF directory; returns (model, hf_config).

    ``max_positions`` sizes the rope table (None: the model's max_position_embeddings).
    """
    config = load_hf_config(model_dir)
    max_positions = max_positions or config.max_position_embeddings
    model = build_model(config, read_state_dict(model_dir), dtype, device, max_positions)
    return model, config


def build_model(
    config,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
) -> LlamaModel:
    """Build from an HF config and its state dict (also used by tests on random models)."""
    arch = ModelArchitecture.from_hf_config(config)
    rope = RotaryEmbedding(config, arch.head_dim, max_positions, dtype, device)
    get = _tensor_getter(state_dict, dtype, device)
    pack = str(device).startswith("cpu")

    def linear(*prefixes: str, bias: bool = False) -> Linear:
        """One projection from the named [out, in] weights, fused in the given order."""
        weight = torch.cat([get_rows(p + ".weight") for p in prefixes])
        b = torch.cat([get_rows(p + ".bias") for p in prefixes]) if bias else None
        return Linear(weight, b, pack=pack)

    def get_rows(name: str) -> torch.Tensor:
        # q and k rows are reordered for the model's rope layout (see interleave_rope_rows).
        if ".q_proj." in name:
            return interleave_rope_rows(get(name), arch.num_heads)
        if ".k_proj." in name:
            return interleave_rope_rows(get(name), arch.num_kv_heads)
        return get(name)

    layers = []
    for i in range(arch.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layers.append(
            DecoderLayer(
                arch,
                input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                qkv=linear(attn + "q_proj", attn + "k_proj", attn + "v_proj", bias=arch.qkv_bias),
                o=linear(attn + "o_proj", bias=arch.o_bias),
                post_attention_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up=linear(mlp + "gate_proj", mlp + "up_proj", bias=arch.mlp_bias),
                down=linear(mlp + "down_proj", bias=arch.mlp_bias),
            )
        )
    head = "model.embed_tokens" if arch.tie_word_embeddings else "lm_head"
    model = LlamaModel(
        arch,
        rope,
        embed_tokens=get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=get("model.norm.weight"),
        lm_head=linear(head),
    )
    return model.eval()


def _tensor_getter(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, device
) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return state_dict[name].to(device=device, dtype=dtype)

    return get
