"""``specserve train kangaroo``: Kangaroo's adapter on the target's first layers.

1. Data: the answers and final features the other drafters use (``answers.pt``,
   ``features.pt``), and the hidden states after the target's layer ``exit_layer - 1`` at every
   position, float16: read from the layers kept beside the shards of ``specserve train data
   --keep-layers`` where they hold that layer (EAGLE-3's low layer is Kangaroo's default
   exit), else computed (the shallow sub-network is a small part of the model).
2. Draft vocabulary: the answer tokens the target writes most.
3. Training, Kangaroo's: the adapter reads the shallow hidden states and its readout is pulled
   to the target's distribution over the draft vocabulary (soft cross-entropy) at every answer
   position. The adapter drafts from real tokens at every step (the shallow layers read the
   draft tokens themselves), so one depth is all it needs. Adam; a checkpoint every epoch.
4. Held-out: top-i accuracy against the target's own next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.toolkit import KangarooAdapter, TrainedDrafter
from tooling.training.data import training_splits
from tooling.training.epochs import TrainingRun, train_epochs, write_drafter
from tooling.training.layer_cache import cached_layer_features
from tooling.training.self_distillation import (
    answer_mask,
    padded,
    progress_bar,
    sequence_features,
)
from tooling.training.shards import kept_layers_with
from tooling.training.train_heads import draft_vocabulary
from tooling.training.warm_start import initial_drafter


@dataclass
class KangarooTrainOptions:
    output: Path
    num_prompts: int = 480
    num_held_out: int = 48
    max_tokens: int = 192
    temperature: float = 0.0
    exit_layer: int = 2  # the shallow sub-network: the target's layers 0 .. exit_layer - 1
    draft_vocab_size: int = 4096
    top_k: int = 4
    epochs: int = 3
    batch_size: int = 8  # sequences per step
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"  # or "cosine": decays to zero over the run
    precision: str = "float32"  # of the training passes: bfloat16 (autocast) or "auto"
    generation_batch: int = 32
    seed: int = 0
    resume: bool = False
    prompts: tuple[list, list] | None = None
    data: tuple[Path, ...] | None = None  # `specserve train data` sets, not the prompts
    data_tokens: int | None = None  # of the shards' training answer tokens (None: all)
    data_from: int | None = None  # leave out the shards' first N training answer tokens
    init_from: str | None = None  # a drafter directory (or "shipped") to train on from


def _logits_and_teacher(adapter, model, readout, split, shallow, index):
    """[B, T, V'] adapter logits and the target's distributions, and the answer mask."""
    hidden = padded([shallow[i] for i in index])
    features = padded([split.features[i] for i in index])
    batch, width = hidden.shape[:2]
    rope = model.rope.lookup(torch.arange(width).repeat(batch))
    logits = adapter.forward_train(hidden, rope) @ readout.T
    teacher = torch.softmax(features @ readout.T, dim=-1)
    return logits, teacher, answer_mask(split, index, width)


@torch.no_grad()
def _held_out_accuracy(adapter, model, readout, vocab, split, shallow, top_k) -> list[float]:
    to_row = torch.full((model.arch.vocab_size,), -2, dtype=torch.long)
    to_row[vocab] = torch.arange(len(vocab))
    hits, seen = torch.zeros(top_k), 0
    for first in range(0, len(split.sequences), 8):
        index = list(range(first, min(first + 8, len(split.sequences))))
        logits, _, mask = _logits_and_teacher(adapter, model, readout, split, shallow, index)
        following = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(split.sequences[i][1:] + [0]) for i in index], batch_first=True
        )
        top = logits[mask].topk(top_k, dim=-1).indices
        hits += (top == to_row[following[mask]][:, None]).sum(0).float()
        seen += int(mask.sum())
    return (hits / max(seen, 1)).tolist()


def shallow_features(model, split, layer: int, what: str):
    """Per conversation of ``split``, [len, d] float16: the outputs of the target's ``layer``,
    for each shard set of the split from the kept layers beside its shards where a set holds
    it (no pass, and mapped from the files rather than held: the whole 10M-token set would be
    about 12 GB in float16), else computed now."""
    d = model.arch.hidden_size
    sources = split.sources or [None]
    rows: list[torch.Tensor] = []
    with progress_bar(len(split.sequences), f"{what}: layer {layer + 1}") as bar:
        for source in sources:
            kept = None if source is None else kept_layers_with(source.directory, layer)
            if kept is None:
                start = len(rows)
                end = start + source.count if source else len(split.sequences)
                sequences = split.sequences[start:end]
                computed = sequence_features(model, sequences, progress=bar.update, layer=layer)
                rows += [r.to(torch.float16) for r in computed]
                continue
            column = kept.index(layer) * d
            cached = cached_layer_features(model, source.directory, kept, source.count,
                                           bar.update, source.first)  # fmt: skip
            rows += [r[:, column : column + d] for r in cached]
    return rows


def run_train_kangaroo(llm, options: KangarooTrainOptions) -> TrainedDrafter:
    from engine.toolkit import dense_weight

    run = TrainingRun()
    torch.manual_seed(options.seed)
    model = llm.engine.model
    arch = model.arch
    if not 1 <= options.exit_layer < arch.num_layers:
        raise ValueError(f"--exit-layer must be in [1, {arch.num_layers - 1}]")
    splits = training_splits(llm, options)
    shallow = {
        name: shallow_features(model, split, options.exit_layer - 1, name)
        for name, split in splits.items()
    }
    train = splits["train"]
    labels = train.answer_labels()
    start = initial_drafter(options, "kangaroo", KangarooAdapter, model, run,
                            {"exit_layer": options.exit_layer})  # fmt: skip
    vocab = start.draft_vocab if start else draft_vocabulary(labels, options.draft_vocab_size)
    print(f"draft vocabulary: {len(vocab)} tokens, {torch.isin(labels, vocab).float().mean():.1%}"
          " of training labels")  # fmt: skip
    readout = dense_weight(model.lm_head)[vocab].float()
    if start:
        adapter = start.network
    else:
        adapter = KangarooAdapter(
            arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.rms_norm_eps, options.exit_layer,
        )  # fmt: skip
        with torch.no_grad():  # start as a plain early exit through the target's final norm
            adapter.output_norm.copy_(model.final_norm.float())
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=options.learning_rate)

    def loss_of(index: list[int]) -> torch.Tensor:
        logits, teacher, mask = _logits_and_teacher(
            adapter, model, readout, train, shallow["train"], index
        )
        return -(teacher[mask] * torch.log_softmax(logits[mask], dim=-1)).sum(-1).mean()

    train_epochs(adapter, optimizer, options, len(train.sequences), loss_of, run=run)
    accuracy = _held_out_accuracy(
        adapter, model, readout, vocab, splits["held_out"], shallow["held_out"], options.top_k
    )
    print("held-out: top-i accuracy " + ", ".join(f"{a:.1%}" for a in accuracy))
    return write_drafter(
        "kangaroo", adapter, vocab, [accuracy], model, options, int(len(labels)), run
    )
