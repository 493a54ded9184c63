"""The target's layer outputs an EAGLE-3 drafter fuses, computed once per shard and kept
beside the shards (``<split>/layers-1-14-26/shard-NNNNN.pt``, float16): the teacher-forced
pass costs about as much as a training epoch on a CPU, and every later run on the same data
(another epoch budget, another seed, `train evaluate`) reads it back instead. Shards made by
`specserve train data --keep-layers` have theirs from the generation already."""

from __future__ import annotations

from pathlib import Path

import torch

from tooling.training.self_distillation import FeatureSplit, sequence_features
from tooling.training.shards import layer_directory, load_shard, save_layer_rows, shard_paths


def cached_layer_features(model, split: Path, layers: tuple[int, ...], count: int,
                          progress=None, first: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """Per conversation first .. first + count - 1 of the split (in ``load_split``'s order),
    [len, layers * d] float16: the layers' outputs side by side. ``progress(n)`` counts
    conversations, read back or computed."""
    kept = layer_directory(split, layers)
    rows: list[torch.Tensor] = []
    position = 0  # index of the shard's first conversation
    for path in shard_paths(Path(split)):
        if position >= first + count:
            break
        cache = kept / path.name
        if cache.is_file():
            shard = torch.load(cache, weights_only=True, mmap=True)  # as load_shard: mapped
            counted = False
        else:
            sequences = [c.tokens for c in load_shard(path)]
            if position + len(sequences) <= first:  # wholly before: never computed
                position += len(sequences)
                continue
            shard = [
                r.to(torch.float16)
                for r in sequence_features(model, sequences, progress=progress, layer=layers)
            ]
            save_layer_rows(Path(split), layers, path.name, shard)
            shard = torch.load(cache, weights_only=True, mmap=True)  # the file's pages, not ours
            counted = True
        wanted = shard[max(0, first - position) : first + count - position]
        if progress is not None and not counted:
            progress(len(wanted))
        rows += wanted
        position += len(shard)
    return rows


def split_layer_features(model, split: FeatureSplit, layers: tuple[int, ...],
                         progress=None) -> list[torch.Tensor]:  # fmt: skip
    """``cached_layer_features`` for every sequence of a split made of shards (one data set
    or several learnt from together), in the split's order."""
    rows: list[torch.Tensor] = []
    for source in split.sources:
        rows += cached_layer_features(model, source.directory, layers, source.count, progress,
                                      source.first)  # fmt: skip
    if len(rows) != len(split.sequences):
        raise ValueError(f"{len(split.sequences)} sequences, {len(rows)} from their shards")
    return rows
