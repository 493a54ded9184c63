"""A model read from a GGUF file as stored computes what its dequantized copy computes.

A tiny random checkpoint is written twice: as a GGUF with a mix of stored formats (llama.cpp's
tensor names, q/k rows permuted as llama.cpp's converter does for the llama architecture, not
for qwen2), and as safetensors of exactly those weights dequantized. Our model must give the
same logits from both (the real SmolLM2 GGUF is checked against transformers in
test_model_reference.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.models.gguf_weights import hf_name
from engine.models.loader import load_model
from engine.models.quantized_linear import QuantizedLinear, StackedLinear
from engine.models.rope import interleave_rope_rows
from tests.test_model_reference import chunked_forward
from tests.tiny_models import TINY_VOCAB, save_tiny_model

# Stored format per projection: q, k and v differ, so the fused qkv must stack three products.
FORMAT_OF = {
    "attn_q": "Q4_0",
    "attn_k": "Q8_0",
    "attn_v": "Q4_1",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "F16",
    "token_embd": "Q8_0",
}


def gguf_names(num_layers: int, qkv_bias: bool) -> dict[str, str]:
    """Hugging Face name -> llama.cpp name for every tensor of a tiny model."""
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(num_layers):
        parts = [*FORMAT_OF, "attn_norm", "ffn_norm"]
        names += [f"blk.{i}.{p}.weight" for p in parts if p != "token_embd"]
        if qkv_bias:  # Qwen2
            names += [f"blk.{i}.{p}.bias" for p in ("attn_q", "attn_k", "attn_v")]
    return {hf_name(n): n for n in names}


def write_pair(tmp_path, model_type: str):
    """(GGUF model dir, safetensors dir of the same dequantized weights)."""
    from safetensors.torch import load_file, save_file

    hf_dir = save_tiny_model(tmp_path / "hf", model_type, hidden_size=64, intermediate_size=128)
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    gguf_dir, ref_dir = tmp_path / "gguf", tmp_path / "ref"
    gguf_dir.mkdir()
    ref_dir.mkdir()
    writer = GGUFWriter(str(gguf_dir / "model.gguf"), model_type)
    reference = {}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for hf, name in gguf_names(config["num_hidden_layers"], model_type == "qwen2").items():
        weight = state[hf].float()
        kind = name.split(".")[-2]
        fmt = FORMAT_OF.get(kind, "F32") if name.endswith(".weight") else "F32"
        stored = weight
        if kind in heads and model_type == "llama":  # llama.cpp's converter permutes these
            stored = interleave_rope_rows(weight, heads[kind])
        if fmt == "F32":
            writer.add_tensor(name, stored.numpy())
            reference[hf] = weight
            continue
        blocks = quantize(stored.numpy(), GGMLQuantizationType[fmt])
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[fmt])
        exact = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).copy()).float()
        if kind in heads and model_type == "llama":  # undo the permutation for safetensors
            order = interleave_rope_rows(torch.arange(len(exact)), heads[kind])
            exact = exact[torch.argsort(order)]
        reference[hf] = exact.reshape(weight.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for d in (gguf_dir, ref_dir):
        (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"))
    return gguf_dir, ref_dir


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_model_equals_its_dequantized_copy(tmp_path, model_type, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_dir, ref_dir = write_pair(tmp_path, model_type)
    ours, _ = load_model(gguf_dir, torch.float32, "cpu", None)
    reference, _ = load_model(ref_dir, torch.float32, "cpu", None)
    layer = ours.layers[0]
    assert isinstance(layer.qkv, StackedLinear)  # three formats cannot share one weight
    assert isinstance(layer.gate_up, QuantizedLinear) and layer.gate_up.stored.format == "Q4_1"
    assert isinstance(ours.lm_head, QuantizedLinear)  # tied: shares the stored embedding
    assert ours.lm_head.stored.codes.data_ptr() == ours.embed_tokens.codes.data_ptr()
    tokens = torch.randint(0, TINY_VOCAB, (19,), generator=torch.Generator().manual_seed(0))
    got = chunked_forward(ours, tokens, [11, 1, 7])
    want = chunked_forward(reference, tokens, [11, 1, 7])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gguf_weights_stay_stored_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_dir, ref_dir = write_pair(tmp_path, "llama")
    ours, _ = load_model(gguf_dir, torch.float32, "cpu", None)
    dense, _ = load_model(ref_dir, torch.float32, "cpu", None)
    # Bytes a decode step reads: the stored forms are far smaller than float32.
    assert ours.weight_bytes_per_token < 0.5 * dense.weight_bytes_per_token
    assert np.isclose(
        ours.embed_tokens.nbytes, TINY_VOCAB * 64 * (1 + 2 / 32)
    )  # Q8_0 at rest: one byte per weight, a float16 scale per 32
