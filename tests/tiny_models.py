"""Tiny random Llama-family checkpoints, written as real Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 320


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random checkpoint with ``save_pretrained``; returns its directory."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
        # A wide init gives logits with clear gaps, so float noise cannot flip an argmax.
        initializer_range=0.15,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path)
    return path


def save_perturbed_copy(source: Path, path: Path, noise: float, seed: int = 1) -> Path:
    """Write ``source``'s checkpoint with Gaussian noise of std ``noise`` added to every weight:
    a separate model that shares the vocabulary and mostly agrees with ``source`` (a draft
    model with its own KV cache whose drafts are often, not always, accepted)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise)
    model.save_pretrained(path)
    return path


def save_heads_drafter(model_dir: Path, path: Path, kind: str = "medusa", num_heads: int = 3,
                       scale: float = 0.0, seed: int = 0) -> Path:  # fmt: skip
    """A ``kind`` (medusa or hydra) drafter directory for the model in ``model_dir``: heads as
    initialised (every head the identity on the hidden state, guessing what the target itself
    would say next) plus random weights of ``scale``, the whole vocabulary as draft vocabulary,
    and made-up held-out accuracies that shape a branching tree."""
    import json

    import torch

    from engine.decoders.drafter_files import TrainedDrafter
    from tooling.training.train_heads import HEADS

    config = json.loads((model_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = HEADS[kind](num_heads, hidden)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": config["num_hidden_layers"]}
    accuracies = [[0.5, 0.3, 0.1] for _ in range(num_heads)]
    TrainedDrafter(kind, heads, torch.arange(vocab), accuracies, target, {"test": True}).save(path)
    return path


def save_eagle_drafter(
    model_dir: Path, path: Path, seed: int = 0, scale: float = 1.0, draft_vocab=None,
    input_norm: bool = True,
) -> Path:
    """An EAGLE drafter for the tiny model: a randomly initialised layer (PyTorch's default
    initialisation, scaled), the whole vocabulary as draft vocabulary unless given."""
    import json

    from engine.decoders.drafter_files import TrainedDrafter
    from engine.decoders.eagle import EagleNetwork

    config = json.loads((model_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    torch.manual_seed(seed)
    network = EagleNetwork(
        hidden, heads, kv_heads, hidden // heads, config["intermediate_size"],
        config["rms_norm_eps"], input_norm=input_norm,
    )  # fmt: skip
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.mul_(scale)
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": config["num_hidden_layers"]}
    accuracies = [[0.5, 0.2], [0.4, 0.2]]
    vocabulary = torch.arange(vocab) if draft_vocab is None else draft_vocab
    TrainedDrafter("eagle", network, vocabulary, accuracies, target, {"test": True}).save(path)
    return path


def save_eagle3_drafter(
    model_dir: Path, path: Path, seed: int = 0, draft_vocab=None, feature_layers=(0, 1, 2)
) -> Path:
    """An EAGLE-3 drafter for the tiny model: random weights (PyTorch's initialisation, the
    norms and head perturbed so every piece matters), fusing ``feature_layers``; the whole
    vocabulary as draft vocabulary unless given."""
    import json

    from engine.decoders.drafter_files import TrainedDrafter
    from engine.decoders.eagle3 import Eagle3Network

    config = json.loads((model_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    vocabulary = torch.arange(vocab) if draft_vocab is None else draft_vocab
    torch.manual_seed(seed)
    network = Eagle3Network(
        hidden, heads, kv_heads, hidden // heads, config["intermediate_size"],
        config["rms_norm_eps"], len(vocabulary), list(feature_layers),
    )  # fmt: skip
    with torch.no_grad():
        for norm in (network.embed_norm, network.hidden_norm, network.norm):
            norm.add_(0.1 * torch.randn_like(norm))
        network.lm_head.weight.mul_(8.0)  # logits with a spread, like a trained head's
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": config["num_hidden_layers"]}
    accuracies = [[0.5, 0.2], [0.4, 0.2]]
    TrainedDrafter("eagle3", network, vocabulary, accuracies, target, {"test": True}).save(path)
    return path


def save_kangaroo_drafter(
    model_dir: Path,
    path: Path,
    exit_layer: int = 1,
    seed: int = 0,
    draft_vocab=None,
    output_scale: float = 0.05,
) -> Path:
    """A Kangaroo adapter for the tiny model after its first ``exit_layer`` layers: random
    weights (its output projection too, of standard deviation ``output_scale``, so the
    attention matters), the whole vocabulary as draft vocabulary unless given."""
    import json

    from engine.decoders.drafter_files import TrainedDrafter
    from engine.decoders.kangaroo import KangarooAdapter

    config = json.loads((model_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    torch.manual_seed(seed)
    adapter = KangarooAdapter(
        hidden, heads, kv_heads, hidden // heads, config["rms_norm_eps"], exit_layer
    )
    with torch.no_grad():
        adapter.o.weight.normal_(0, output_scale)
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": config["num_hidden_layers"]}
    vocabulary = torch.arange(vocab) if draft_vocab is None else draft_vocab
    TrainedDrafter("kangaroo", adapter, vocabulary, [[0.5, 0.2]], target, {"test": True}).save(path)
    return path
