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
    joined,
    progress_bar,
)
from tooling.training.shards import build_from_file, default_root, load_split, recipe_for


def training_splits(llm, options, roots: list[Path] | None = None) -> dict[str, FeatureSplit]:
    """The training and held-out splits a drafter learns from: the shards of each set in
    ``options.data`` (``specserve train data``; several are learnt from together, each up to
    ``options.data_tokens`` answer tokens of training, the only one less its first
    ``options.data_from``), their held-out splits together; else the built-in prompts (or
    ``options.prompts``) answered now and cached in the output directory."""
    # A conversations file is answered now and kept in the cache (``roots``: already done).
    roots = roots if roots is not None else shard_roots(llm, options)
    if roots:
        skip = getattr(options, "data_from", None) or 0  # (callers' options may predate it)
        if skip and len(roots) > 1:
            raise ValueError("--data-from leaves out the start of one set: give one --data")
        train = [load_split(root / "train", options.data_tokens, skip) for root in roots]
        for root, split in zip(roots, train, strict=True):
            if not split.sequences:
                raise ValueError(
                    f"{root / 'train'}: no conversations after the first {skip:,} "
                    "answer tokens (--data-from)"
                )
        return {
            "train": joined(train),
            "held_out": joined([load_split(root / "held_out") for root in roots]),
        }
    prompts = options.prompts or train_and_held_out(
        options.num_prompts, options.num_held_out, options.seed
    )
    return cached_features(llm, options, cached_answers(llm, options, prompts))


def data_paths(options) -> list[Path]:
    """``options.data``: none, one path (callers' options may name one) or several."""
    data = getattr(options, "data", None)
    if not data:
        return []
    return [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]


def shard_roots(llm, options) -> list[Path]:
    """The shard directories ``training_splits`` reads (none: the built-in prompts); a
    conversations file named instead is answered into the cache first."""
    return [
        path if path.is_dir() else _shards_of_file(llm, path, options.data_tokens)
        for path in data_paths(options)
    ]


def _shards_of_file(llm, path: Path, budget: int | None) -> Path:
    root = default_root(llm.model_dir, path)
    with progress_bar(budget or 0, "answer tokens") as bar:
        build_from_file(llm, path, root, recipe_for(llm), budget or 10**12, None, bar.update)
    return root
