"""A model directory's tokenizer, loaded without the engine (the API process needs only this)."""

from __future__ import annotations

from pathlib import Path

from engine.fast_tokenizer import FastTokenizer


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the directory has none (test models)."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # heavy: only when a model has tokenizer files

    return AutoTokenizer.from_pretrained(model_dir)


def load_api_tokenizer(model_dir: Path):
    """The tokenizer the API process uses: ``FastTokenizer`` (no transformers, so no torch)
    where the model has a tokenizer.json, else the transformers one (a slow tokenizer)."""
    if (model_dir / "tokenizer.json").is_file():

        return FastTokenizer(model_dir)
    return load_tokenizer(model_dir)
