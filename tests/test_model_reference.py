"""Our Llama-family model against transformers' forward on the same weights (for a GGUF model
directory, transformers' float32 dequantization of it: ``load_hf_model``)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SequenceSlice, build_attention_metadata
from engine.kv_cache import KVCache
from engine.models.loader import load_hf_model, load_model
from tests.tiny_models import TINY_VOCAB, save_tiny_model


def chunked_forward(model, token_ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed ``token_ids`` through the paged cache in the given chunk sizes; all logits."""
    a = model.arch
    cache = KVCache(a.num_layers, 64, 16, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    block_table = list(range(63, 0, -1))  # non-contiguous, descending blocks on purpose
    outs, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            meta = build_attention_metadata(
                [SequenceSlice(done, n, block_table)], 16, a.head_dim, "cpu", a.sliding_window
            )
            out = model(
                token_ids[done : done + n], torch.arange(done, done + n), cache.layers, meta
            )
            outs.append(out.logits)
            done += n
    return torch.cat(outs)


def reference_logits(model_dir, token_ids: torch.Tensor) -> torch.Tensor:
    hf = load_hf_model(model_dir, torch.float32)
    with torch.inference_mode():
        return hf(token_ids[None]).logits[0]


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"rope_theta": 500.0, "head_dim": 32}),
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {"sliding_window": 8}),  # shorter than every chunk below
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # biases on q/k/v/o and the MLP
    ],
    ids=[
        "llama-tied-gqa",
        "untied-mha",
        "llama3-rope",
        "rope-theta-head-dim",
        "qwen2-bias",
        "mistral-sliding-window",
        "llama-biases",
    ],
)
def test_tiny_model_logits_match_transformers(tmp_path, model_type, overrides):
    model_dir = save_tiny_model(tmp_path / "m", model_type, **overrides)
    ours, _ = load_model(model_dir, torch.float32, "cpu", None)
    token_ids = torch.randint(0, TINY_VOCAB, (45,), generator=torch.Generator().manual_seed(1))
    expected = reference_logits(model_dir, token_ids)
    # One prefill, a chunk that reads the cache back, single decode tokens, a long chunk.
    got = chunked_forward(ours, token_ids, [20, 17, 1, 1, 1, 5])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    got = chunked_forward(ours, token_ids, [3, 40, 2])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_layer_subset_and_hidden_states(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m")
    ours, _ = load_model(model_dir, torch.float32, "cpu", None)
    hf = load_hf_model(model_dir, torch.float32)
    token_ids = torch.arange(3, 13)
    a = ours.arch
    cache = KVCache(a.num_layers, 8, 16, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    meta = build_attention_metadata([SequenceSlice(0, 10, [0])], 16, a.head_dim, "cpu")
    with torch.inference_mode():
        out = ours(
            token_ids,
            torch.arange(10),
            cache.layers,
            meta,
            hidden_layer=1,
            logits_indices=torch.tensor([9]),
        )
        ref = hf(token_ids[None], output_hidden_states=True)
        # hidden_states[i + 1] is the output of layer i in transformers.
        torch.testing.assert_close(
            out.hidden_states, ref.hidden_states[2][0, 9:], rtol=1e-4, atol=1e-4
        )
        assert out.logits.shape == (1, TINY_VOCAB)
        skipped = ours(token_ids, torch.arange(10), cache.layers, meta, layer_ids=[0, 2])
        # The reference for layer skipping: transformers' model with layer 1 removed.
        hf.model.layers = torch.nn.ModuleList([hf.model.layers[0], hf.model.layers[2]])
        expected = hf(token_ids[None], use_cache=False).logits[0]
        torch.testing.assert_close(skipped.logits, expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(skipped.logits[-1], out.logits[0], atol=1e-3)


@pytest.mark.real_model
def test_smollm2_logits_match_transformers(smollm2_path):
    ours, _ = load_model(smollm2_path, torch.float32, "cpu", None)
    token_ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0))
    expected = reference_logits(smollm2_path, token_ids)
    got = chunked_forward(ours, token_ids, [30, 7, 1, 1, 1])
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
