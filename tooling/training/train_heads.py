"""``specserve train medusa|hydra``: draft heads on the frozen target, by self-distillation.

1. Data: our own prompts (``tooling.training.prompts``) answered by the target, and its hidden
   states along the answers (``tooling.training.self_distillation``); cached in the output
   directory, so ``--resume`` (or a second run) skips it.
2. Draft vocabulary: the answer tokens the target writes most, covering nearly all of them.
3. Training: head j learns the token j + 2 places after each position (cross-entropy on the
   target's own continuation, which for greedy answers is its argmax), read out through the
   target's frozen LM head rows of the draft vocabulary; Hydra's heads also read the true
   tokens before it (teacher forcing). Adam; a checkpoint after every epoch.
4. Held-out: each head's top-i accuracy on answers to prompts it never saw; they rank the
   decoder's tree (``engine.decoders.trained_heads.rank_tree``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.toolkit import HydraHeads, MedusaHeads, TrainedDrafter, rank_tree
from tooling.training.data import training_splits
from tooling.training.epochs import TrainingRun, train_epochs, write_drafter
from tooling.training.self_distillation import answer_features
from tooling.training.warm_start import initial_drafter

HEADS = {"medusa": MedusaHeads, "hydra": HydraHeads}


@dataclass
class HeadsTrainOptions:
    kind: str  # "medusa" or "hydra"
    output: Path
    num_prompts: int = 480
    num_held_out: int = 48
    max_tokens: int = 192
    temperature: float = 0.0
    num_heads: int = 3
    draft_vocab_size: int = 4096
    top_k: int = 4  # candidates per head whose accuracy is measured (the tree's widest fan-out)
    epochs: int = 4
    batch_size: int = 256
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"  # or "cosine": decays to zero over the run
    precision: str = "float32"  # of the training passes: bfloat16 (autocast) or "auto"
    generation_batch: int = 32
    seed: int = 0
    resume: bool = False
    # Prompts instead of the built-in set: (training, held-out), texts (user messages) or token
    # id lists (the model's input as it is).
    prompts: tuple[list, list] | None = None
    data: tuple[Path, ...] | None = None  # `specserve train data` sets, not the prompts
    data_tokens: int | None = None  # of the shards' training answer tokens (None: all)
    data_from: int | None = None  # leave out the shards' first N training answer tokens
    init_from: str | None = None  # a drafter directory (or "shipped") to train on from


def _data(llm, options: HeadsTrainOptions) -> dict:
    """Answers and the features along them for the training and held-out prompts, as rows of
    the positions whose next token is an answer token; both are cached in the output
    directory, so ``--resume`` (or a second run) skips them."""
    splits = training_splits(llm, options)
    data = {}
    for name, split in splits.items():
        features, owners, positions = answer_features(split)
        data[name] = {
            "sequences": split.sequences,
            "features": features.to(torch.float16),
            "owners": owners,
            "positions": positions,
        }
    return data


def tokens_ahead(split: dict, first: int, count: int) -> torch.Tensor:
    """[rows, count] token ids: tokens t + first .. t + first + count - 1 after each row's
    position t; -1 past the sequence's end. Labels are tokens 2.. ahead, Hydra's inputs 1.."""
    sequences = split["sequences"]
    out = torch.full((len(split["owners"]), count), -1, dtype=torch.long)
    owners, positions = split["owners"].tolist(), split["positions"].tolist()
    for r, (i, t) in enumerate(zip(owners, positions, strict=True)):
        ahead = sequences[i][t + first : t + first + count]
        out[r, : len(ahead)] = torch.tensor(ahead, dtype=torch.long)
    return out


def draft_vocabulary(labels: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent label tokens, most frequent first."""
    counts = torch.bincount(labels[labels >= 0])
    size = min(size, int((counts > 0).sum()))
    return counts.topk(size).indices


def to_vocab_index(labels: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Labels as readout rows; -100 (ignored by the loss) outside the draft vocabulary."""
    index = torch.full((int(max(labels.max(), vocab.max())) + 1,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    out = torch.full_like(labels, -100)
    valid = labels >= 0
    out[valid] = index[labels[valid]]
    return out


def _logits(heads, readout, embed, features, inputs) -> torch.Tensor:
    """[heads, B, V'] from [B, d] features and [B, heads] input tokens (-1: past the end)."""
    embeddings = embed(inputs.clamp_min(0).flatten()).float().reshape(*inputs.shape, -1)
    return heads.forward_train(features.float(), embeddings) @ readout.T


@torch.no_grad()
def top_accuracies(heads, readout, embed, features, inputs, targets, top_k: int, batch=1024):
    """[heads][i]: how often the i-th candidate of each head is the label (rows whose label
    is past the end are left out; labels outside the vocabulary count as misses)."""
    num_heads = heads.num_heads
    hits = torch.zeros(num_heads, top_k)
    seen = torch.zeros(num_heads)
    for first in range(0, len(features), batch):
        rows = slice(first, first + batch)
        logits = _logits(heads, readout, embed, features[rows], inputs[rows])
        top = logits.topk(top_k, dim=-1).indices  # [heads, B, k]
        wanted = targets[rows].T  # [heads, B]
        present = wanted != -1
        hits += ((top == wanted[..., None]) & present[..., None]).sum(dim=1).float()
        seen += present.sum(dim=1).float()
    return (hits / seen.clamp_min(1)[:, None]).tolist()


def run_train_heads(llm, options: HeadsTrainOptions) -> TrainedDrafter:
    from engine.toolkit import dense_weight

    run = TrainingRun()
    torch.manual_seed(options.seed)
    model = llm.engine.model
    data = _data(llm, options)
    train_labels = tokens_ahead(data["train"], 2, options.num_heads)
    held_labels = tokens_ahead(data["held_out"], 2, options.num_heads)
    train_inputs = tokens_ahead(data["train"], 1, options.num_heads)
    held_inputs = tokens_ahead(data["held_out"], 1, options.num_heads)
    embed = model.embed
    start = initial_drafter(options, options.kind, HEADS[options.kind], model, run,
                            {"num_heads": options.num_heads})  # fmt: skip
    vocab = start.draft_vocab if start else draft_vocabulary(train_labels, options.draft_vocab_size)
    covered = torch.isin(train_labels[train_labels >= 0], vocab).float().mean().item()
    print(f"draft vocabulary: {len(vocab)} tokens, {covered:.1%} of training labels")
    readout = dense_weight(model.lm_head)[vocab].float()
    train_targets = to_vocab_index(train_labels, vocab)
    held_targets = to_vocab_index(held_labels, vocab)
    # Accuracy counts a label outside the vocabulary as a miss: keep its id (never predicted).
    held_for_accuracy = torch.where(held_targets == -100, len(vocab), held_targets)
    held_for_accuracy[held_labels == -1] = -1
    features = data["train"]["features"]

    if start:
        heads = start.network
    else:
        heads = HEADS[options.kind](options.num_heads, model.arch.hidden_size)
    optimizer = torch.optim.Adam(heads.parameters(), lr=options.learning_rate)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    def loss_of(rows: list[int]) -> torch.Tensor:
        logits = _logits(heads, readout, embed, features[rows], train_inputs[rows])
        targets = train_targets[rows].T  # [heads, B]
        return loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    train_epochs(heads, optimizer, options, len(features), loss_of, run=run)
    accuracies = top_accuracies(
        heads, readout, embed, data["held_out"]["features"], held_inputs, held_for_accuracy,
        options.top_k,
    )  # fmt: skip
    for j, row in enumerate(accuracies):
        print(f"held-out head {j + 1} (token +{j + 2}): top-i accuracy " + ", ".join(
            f"{a:.1%}" for a in row))  # fmt: skip
    for n in (4, 8, 16):
        tree = rank_tree(accuracies, n)
        expected = sum(_path_value(accuracies, path) for path in tree)
        print(f"expected accepted drafts per step, tree of {n} nodes: {expected:.2f}")
    return write_drafter(
        options.kind, heads, vocab, accuracies, model, options, int(len(features)), run
    )


def _path_value(accuracies, path) -> float:
    value = 1.0
    for depth, i in enumerate(path):
        value *= accuracies[depth][i]
    return value
