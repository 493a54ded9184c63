"""Read a GGUF file's tensors as they are stored, under Hugging Face tensor names.

Quantized and half-precision tensors become ``StoredWeight`` (see ``weight_formats``); F32
tensors (norms, and projections a GGUF keeps in F32) become float32 tensors. Nothing is
expanded to float32 at rest. The config and tokenizer come from transformers, which reads the
same file's metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from engine.models.weight_formats import StoredWeight, read_stored

# GGUF tensor name -> Hugging Face name, for the Llama family (llama.cpp's naming).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

Weights = dict[str, "torch.Tensor | StoredWeight"]


def find_gguf(model_dir: Path) -> Path | None:
    """The single ``*.gguf`` file a model directory keeps its weights in, if any.

    A directory with safetensors weights is a Hugging Face checkpoint: a ``.gguf`` beside them
    (a second copy, a projector file) is not its weights, so None."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        return None
    found = sorted(model_dir.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{model_dir} holds several .gguf files: {[p.name for p in found]}")
    return found[0] if found else None


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_gguf_weights(path: Path) -> tuple[Weights, bool]:
    """(weights by HF name, whether q/k rows are already in the interleaved rope layout).

    llama.cpp's converter permutes the q and k rows of ``llama``-architecture models into
    adjacent rotation pairs, which is exactly our model's layout (see ``interleave_rope_rows``);
    other architectures (qwen2) keep Hugging Face's layout.
    """
    # gguf: only for a GGUF checkpoint
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.fields["general.architecture"]
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
    weights: Weights = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: derived from the config instead
        rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
        if t.tensor_type.name == "F32":
            data = np.array(t.data, dtype=np.float32)  # a copy: the file map is closed below
            weights[name] = torch.from_numpy(data.reshape(rows, -1) if len(t.shape) > 1 else data)
        else:
            weights[name] = read_stored(t.tensor_type.name, np.asarray(t.data), rows)
    del reader  # unmap the file: only the copies above stay resident
    return weights, architecture == "llama"
