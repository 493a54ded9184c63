"""Load a Llama-family checkpoint (a local directory) into ``LlamaModel``.

transformers supplies the config. A directory that keeps a GGUF file has its weights read
from it as stored (quantized projections stay quantized, see ``gguf_weights``); otherwise
safetensors are read. Weights are re-laid-out once at load time (q/k/v and gate/up fused,
dense projections prepacked where that is faster), and the products of quantized ones are
autotuned for this machine (``autotune``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine.models.autotune import autotune
from engine.models.gguf_weights import find_gguf, read_gguf_weights
from engine.models.linear import Linear
from engine.models.llama import DecoderLayer, LlamaModel, ModelArchitecture
from engine.models.quantized_linear import QuantizedLinear, StackedLinear
from engine.models.rope import RotaryEmbedding, interleave_rope_rows
from engine.models.weight_formats import StoredWeight, cat_rows, dequantize_torch

Weight = torch.Tensor | StoredWeight

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def load_hf_config(model_dir: Path):

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
    gguf = find_gguf(model_dir)
    if gguf is not None:
        weights, rope_interleaved = read_gguf_weights(gguf)
        model = build_model(config, weights, dtype, device, max_positions, rope_interleaved)
        autotune(model)
    else:
        model = build_model(config, read_state_dict(model_dir), dtype, device, max_positions)
    return model, config


def build_model(
    config,
    state_dict: Mapping[str, Weight],
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    rope_interleaved: bool = False,
) -> LlamaModel:
    """Build from an HF config and its weights by HF name (also used by tests on random
    models). Weights are dense tensors or ``StoredWeight``s; ``rope_interleaved`` says q/k rows
    are already in the model's rope layout (llama.cpp's GGUF conversion does that)."""
    arch = ModelArchitecture.from_hf_config(config)
    rope = RotaryEmbedding(config, arch.head_dim, max_positions, dtype, device)
    get = _tensor_getter(state_dict, dtype, device)
    pack = str(device).startswith("cpu")

    def linear(*prefixes: str, bias: bool = False) -> nn.Module:
        """One projection from the named [out, in] weights, fused in the given order."""
        weights = [get_rows(p + ".weight") for p in prefixes]
        b = torch.cat([get_rows(p + ".bias") for p in prefixes]) if bias else None
        if all(isinstance(w, torch.Tensor) for w in weights):
            return Linear(torch.cat(weights), b, pack=pack)
        stored = [w if isinstance(w, StoredWeight) else None for w in weights]
        fused = None if None in stored else cat_rows(stored)
        if fused is not None:
            return QuantizedLinear(fused, b)
        # Parts in different formats (a GGUF quantization mix): one product each.
        sizes = [w.shape[0] for w in weights]
        biases = b.split(sizes) if b is not None else [None] * len(weights)
        parts = [_single_linear(w, bb, pack) for w, bb in zip(weights, biases, strict=True)]
        return StackedLinear(parts)

    def get_rows(name: str) -> Weight:
        # q and k rows are reordered for the model's rope layout (see interleave_rope_rows).
        heads = {".q_proj.": arch.num_heads, ".k_proj.": arch.num_kv_heads}
        for part, num_heads in heads.items():
            # llama.cpp's converter permutes q/k weights and biases alike.
            if part in name and not rope_interleaved:
                return _interleave(get(name), num_heads)
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


def _single_linear(weight: Weight, bias: torch.Tensor | None, pack: bool) -> nn.Module:
    if isinstance(weight, StoredWeight):
        return QuantizedLinear(weight, bias)
    return Linear(weight, bias, pack=pack)


def _interleave(weight: Weight, num_heads: int) -> Weight:
    """``interleave_rope_rows`` for dense and stored weights (a stored one permutes rows)."""
    if isinstance(weight, torch.Tensor):
        return interleave_rope_rows(weight, num_heads)
    rows = torch.arange(weight.shape[0], device=weight.codes.device)
    return weight.select_rows(interleave_rope_rows(rows, num_heads))


def _tensor_getter(
    state_dict: Mapping[str, Weight], dtype: torch.dtype, device
) -> Callable[[str], Weight]:
    def get(name: str) -> Weight:
        if name not in state_dict:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        w = state_dict[name]
        if isinstance(w, StoredWeight) and torch.device(device).type == "cpu":
            return w
        if isinstance(w, StoredWeight):
            # On a GPU the dense product (cuBLAS on tensor cores) is the fast one and there is
            # no quantized GPU kernel here: stored blocks are dequantized once, on the device,
            # to the model's dtype (the values transformers' GGUF loader gives, cast alike).
            return dequantize_torch(w.to(device)).to(dtype)
        return w.to(device=device, dtype=dtype)

    return get


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32, **config_overrides):
    """transformers' model of a model directory: the reference ours must match.

    A directory that keeps a GGUF is loaded from it (``gguf_file=``) with every weight
    dequantized to float32 (then cast to ``dtype``), i.e. the values our quantized products
    compute with; its config is the directory's config.json, as ours, and so is its generation
    config. Otherwise the plain ``from_pretrained`` (safetensors). ``config_overrides`` go to
    the config (e.g. ``num_hidden_layers``).
    """

    model_dir = Path(model_dir)
    gguf = find_gguf(model_dir)
    if gguf is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **config_overrides)
        return model.eval()
    try:  # transformers >= 5 can keep GGUF blocks packed; the reference wants them dequantized
        from transformers import GgufConfig

        quantization = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older versions always dequantize
        quantization = {}
    config = AutoConfig.from_pretrained(model_dir, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf.name, config=config, dtype=dtype, **quantization
    )
    if (model_dir / "generation_config.json").is_file():  # not read when loading a GGUF
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()
