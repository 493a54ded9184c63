"""Load a Hugging Face Llama-family checkpoint (a local directory) into ``LlamaModel``.

transformers supplies the config; tensors are read with safetensors and re-laid-out once
at load time (q/k/v and gate/up fused, every projection transposed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.llama import LlamaModel, ModelArchitecture
from engine.models.rope import RotaryEmbedding

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
    with torch.device("meta"):
        model = LlamaModel(arch, rope)
    get = _tensor_getter(state_dict, dtype, device)

    def t(name: str) -> torch.Tensor:  # [out, in] -> [in, out], contiguous
        return get(name).t().contiguous()

    params: dict[str, torch.Tensor] = {
        "embed_t": t("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight"),
    }
    if not arch.tie_word_embeddings:
        params["lm_head_t"] = t("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        params[f"layers.{i}.input_norm"] = get(p + "input_layernorm.weight")
        params[f"layers.{i}.post_attention_norm"] = get(p + "post_attention_layernorm.weight")
        qkv = [get(f"{attn}{n}_proj.weight") for n in "qkv"]
        params[f"layers.{i}.qkv_t"] = torch.cat(qkv).t().contiguous()
        if arch.qkv_bias:
            params[f"layers.{i}.qkv_bias"] = torch.cat([get(f"{attn}{n}_proj.bias") for n in "qkv"])
        params[f"layers.{i}.o_t"] = t(attn + "o_proj.weight")
        gate_up = [get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]
        params[f"layers.{i}.gate_up_t"] = torch.cat(gate_up).t().contiguous()
        params[f"layers.{i}.down_t"] = t(mlp + "down_proj.weight")
    model.load_state_dict(params, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _tensor_getter(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, device
) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return state_dict[name].to(device=device, dtype=dtype)

    return get
