"""``specserve train eagle3``: EAGLE-3's drafter, by self-distillation.

The data and the training-time test are EAGLE's (``tooling.training.train_eagle``); what
differs is what the drafter reads and how it reads out:

1. One teacher-forced pass over every conversation keeps the outputs of the three target layers
   the drafter fuses (``engine.decoders.eagle3.default_feature_layers``), float16 in memory.
2. Depth 1 reads ``fc`` over them (trained with the rest; it starts as the high layer alone);
   depth s reads the depth s - 1 output one position earlier, as at inference.
3. The drafter reads out through its own final norm and head over the draft vocabulary
   (started from the target's final norm and LM head rows), and learns the target's
   distribution over the draft vocabulary alone (EAGLE-3's loss: no feature regression, since
   the layer's output need not be the target's feature).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.toolkit import Eagle3Network, TrainedDrafter, default_feature_layers
from tooling.training.data import training_splits
from tooling.training.epochs import TrainingRun, curve_recorder, train_epochs, write_drafter
from tooling.training.layer_cache import split_layer_features
from tooling.training.self_distillation import FeatureSplit, padded, progress_bar, sequence_features
from tooling.training.train_eagle import (
    CURVE_SAMPLE,
    EagleTrainOptions,
    _batch,
    _first,
    _losses,
    by_answer_kind,
    held_out_counts,
    padded_rope,
    print_accuracies_by_kind,
    rates,
    unrolled_outputs,
)
from tooling.training.train_heads import draft_vocabulary
from tooling.training.warm_start import grown_vocabulary, initial_drafter


@dataclass
class Eagle3TrainOptions(EagleTrainOptions):
    feature_layers: tuple[int, ...] | None = None  # default: low, middle, high


def layer_features(model, split: FeatureSplit, layers: tuple[int, ...], what: str):
    """Per sequence, [len, layers * d] float16: the layers' outputs side by side; for a split
    of shards, computed once and kept beside them."""
    with progress_bar(len(split.sequences), f"{what} layer features") as bar:
        if split.sources:
            return split_layer_features(model, split, layers, bar.update)
        rows = sequence_features(model, split.sequences, progress=bar.update, layer=layers)
    return [r.to(torch.float16) for r in rows]


def new_network(model, vocab: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Network:
    """A drafter whose head starts as the target's (final norm, LM head rows of the draft
    vocabulary) and whose ``fc`` starts by passing the highest fused layer through."""
    from engine.toolkit import dense_weight

    arch = model.arch
    d = arch.hidden_size
    network = Eagle3Network(
        d, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
        arch.rms_norm_eps, len(vocab), list(layers),
    )  # fmt: skip
    with torch.no_grad():
        network.lm_head.weight.copy_(dense_weight(model.lm_head)[vocab].float())
        network.norm.copy_(model.final_norm.float())
        network.fc.weight.zero_()
        high = max(range(len(layers)), key=lambda i: layers[i])
        network.fc.weight[:, high * d : (high + 1) * d] = torch.eye(d)
    return network


def grow_head(network: Eagle3Network, trained: int, target_rows: torch.Tensor) -> None:
    """The head over a grown draft vocabulary (``target_rows``: the target's LM head rows of
    it): the first ``trained`` rows as the network learnt them, the new ones the target's own,
    as a new network's head starts."""
    if len(target_rows) == trained:
        return
    old = network.lm_head.weight.detach()
    head = torch.nn.Linear(old.shape[1], len(target_rows), bias=False)
    with torch.no_grad():
        head.weight.copy_(target_rows.float())
        head.weight[:trained] = old[:trained]
    network.lm_head = head
    network.shape["draft_vocab_size"] = len(target_rows)


def run_train_eagle3(llm, options: Eagle3TrainOptions) -> TrainedDrafter:
    from engine.toolkit import dense_weight

    run = TrainingRun()
    torch.manual_seed(options.seed)
    model = llm.engine.model
    arch = model.arch
    wanted = {"feature_layers": list(options.feature_layers)} if options.feature_layers else {}
    start = initial_drafter(options, "eagle3", Eagle3Network, model, run, wanted)
    if start:
        layers = tuple(start.network.shape["feature_layers"])
    else:
        layers = tuple(options.feature_layers or default_feature_layers(arch.num_layers))
    splits = training_splits(llm, options)
    train, held_out = splits["train"], splits["held_out"]
    labels = train.answer_labels()
    size = options.draft_vocab_size
    vocab = (
        grown_vocabulary(start.draft_vocab, labels, size)
        if start
        else draft_vocabulary(labels, size)
    )
    if start:
        grow_head(start.network, len(start.draft_vocab), dense_weight(model.lm_head)[vocab])
    covered = torch.isin(labels, vocab).float().mean().item()
    print(f"draft vocabulary: {len(vocab)} tokens, {covered:.1%} of training labels")
    readout = dense_weight(model.lm_head)[vocab].float()  # the teacher's rows
    inputs = {
        name: layer_features(model, split, layers, what)
        for name, split, what in (("train", train, "training"), ("held_out", held_out, "held-out"))
    }

    rope_of = padded_rope(model)
    network = start.network if start else new_network(model, vocab, layers)
    optimizer = torch.optim.AdamW(network.parameters(), lr=options.learning_rate)

    def fused(split: str, index: list[int]) -> torch.Tensor:
        return network.fuse(padded([inputs[split][i] for i in index]).float())

    def loss_of(index: list[int]) -> torch.Tensor:
        embeddings, features, _, answer = _batch(train, index, model.embed)
        outputs = unrolled_outputs(
            network, rope_of(features.shape[:2]), embeddings, fused("train", index),
            options.depth, options.feature_noise,
        )  # fmt: skip
        return sum(_losses(outputs, features, readout, answer, False, network.logits))

    sample = _first(held_out, CURVE_SAMPLE)

    def counts(split, top_k: int, only: list[int] | None = None):
        return held_out_counts(
            network, rope_of, split, model.embed, readout, vocab, arch.vocab_size,
            options.depth, top_k, inputs_of=lambda index, _: fused("held_out", index),
            head=network.logits, only=only,
        )  # fmt: skip

    after_step = curve_recorder(
        run,
        lambda batch: sum(train.answer_tokens(i) for i in batch),
        lambda: [round(row[0], 4) for row in rates(counts(sample, 1))],
    )

    train_epochs(
        network, optimizer, options, len(train.sequences), loss_of, 1.0, run, after_step
    )
    result = by_answer_kind(lambda only: counts(held_out, options.top_k, only), held_out)
    print_accuracies_by_kind(result)
    return write_drafter("eagle3", network, vocab, result, model, options, int(len(labels)), run)


def evaluate_eagle3(llm, drafter_dir: str | None, data, depth: int = 3, top_k: int = 4):
    """``evaluate_eagle`` for an EAGLE-3 drafter (ours, or one in the public layout)."""
    from engine.toolkit import dense_weight, load_drafter
    from tooling.training.shards import load_split

    model = llm.engine.model
    drafter = load_drafter(drafter_dir, "eagle3", Eagle3Network, model)
    network, vocab = drafter.network.float(), drafter.draft_vocab
    split = load_split(Path(data) / "held_out")
    layers = tuple(network.shape["feature_layers"])
    inputs = layer_features(model, split, layers, "held-out")

    rope_of = padded_rope(model)
    readout = dense_weight(model.lm_head)[vocab].float()
    return by_answer_kind(
        lambda only: held_out_counts(
            network, rope_of, split, model.embed, readout, vocab, model.arch.vocab_size, depth,
            top_k, head=network.logits, only=only,
            inputs_of=lambda index, _: network.fuse(padded([inputs[i] for i in index]).float()),
        ),
        split,
    )  # fmt: skip
