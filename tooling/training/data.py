"""Where a drafter's training data comes from: the shards of ``specserve train data`` (our own
requests, or a user's conversations file answered by the target), or the built-in prompts
answered at training time (the small set the tests use)."""

from __future__ import annotations

from pathlib import Path

from tooling.training.prompts import train_and_held_out
from tooling.training.self_distillation import (
    FeatureSplit,
    cached_answers,
    cached_features,
    progress_bar,
)
from tooling.training.shards import build_from_file, default_root, load_split, recipe_for


def training_splits(llm, options, root: Path | None = None) -> dict[str, FeatureSplit]:
    """The training and held-out splits a drafter learns from: the shards of
    ``options.data`` (``specserve train data``), up to ``options.data_tokens`` answer tokens of
    training, less the first ``options.data_from``; else the built-in prompts (or
    ``options.prompts``) answered now and cached in the output directory."""
    # A conversations file is answered now and kept in the cache (``root``: already done).
    root = root or shard_root(llm, options)
    if root is not None:
        skip = getattr(options, "data_from", None) or 0  # (callers' options may predate it)
        train = load_split(root / "train", options.data_tokens, skip)
        if not train.sequences:
            raise ValueError(
                f"{root / 'train'}: no conversations after the first {skip:,} "
                "answer tokens (--data-from)"
            )
        return {
            "train": train,
            "held_out": load_split(root / "held_out"),
        }
    prompts = options.prompts or train_and_held_out(
        options.num_prompts, options.num_held_out, options.seed
    )
    return cached_features(llm, options, cached_answers(llm, options, prompts))


def shard_root(llm, options) -> Path | None:
    """The shard directory ``training_splits`` reads (None: the built-in prompts)."""
    if not getattr(options, "data", None):
        return None
    root = Path(options.data)
    return root if root.is_dir() else _shards_of_file(llm, root, options.data_tokens)


def _shards_of_file(llm, path: Path, budget: int | None) -> Path:
    root = default_root(llm.model_dir, path)
    with progress_bar(budget or 0, "answer tokens") as bar:
        build_from_file(llm, path, root, recipe_for(llm), budget or 10**12, None, bar.update)
    return root
