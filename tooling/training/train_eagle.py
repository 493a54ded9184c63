"""``specserve train eagle``: EAGLE's one-layer feature-level drafter, by self-distillation.

1. Data: our own prompts answered by the target (``tooling.training.self_distillation``, shared
   with the heads' training through ``answers.pt``), and one teacher-forced pass over every
   prompt + answer for the target's final-normed features at every position (cached in
   ``features.pt``, so ``--resume`` skips both).
2. Draft vocabulary: the answer tokens the target writes most.
3. Training, EAGLE-3's training-time test: depth 1 reads the target's features (with a little
   noise, EAGLE's augmentation); depth s reads the depth s - 1 outputs one position earlier, and
   attends to the target-feature entries up to where drafting started plus its own chain of
   guesses, exactly what the drafter sees at inference when drafting s tokens ahead. At each
   depth the output is pulled towards the target's feature (smooth L1, EAGLE's regression) and
   its readout towards the target's distribution over the draft vocabulary (distillation);
   deeper depths weigh less (0.8 per depth). Adam with a checkpoint after every epoch.
4. Held-out: per depth, the top-i accuracy of the readout against the target's own next token
   (teacher-forced tokens: at depth s, how often draft s is right when drafts 1..s-1 were).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from engine.toolkit import EagleNetwork, TrainedDrafter
from tooling.training.data import training_splits
from tooling.training.epochs import TrainingRun, curve_recorder, train_epochs, write_drafter
from tooling.training.self_distillation import (
    ALL_ANSWERS,
    FeatureSplit,
    answer_mask,
    padded,
)
from tooling.training.train_heads import draft_vocabulary
from tooling.training.warm_start import grown_vocabulary, initial_drafter

# EAGLE's weights: regression 1, classification 0.1; deeper depths count less (EAGLE-3).
CLASSIFICATION_WEIGHT, DEPTH_DECAY = 0.1, 0.8


@dataclass
class EagleTrainOptions:
    output: Path
    num_prompts: int = 480
    num_held_out: int = 48
    max_tokens: int = 192
    temperature: float = 0.0
    depth: int = 3  # training-time-test depths (the chain length it is trained to draft)
    draft_vocab_size: int = 4096
    top_k: int = 4
    epochs: int = 3
    batch_size: int = 8  # sequences per step
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"  # or "cosine": decays to zero over the run
    precision: str = "float32"  # of the training passes: bfloat16 (autocast) or "auto"
    feature_noise: float = 0.05  # std of the Gaussian added to input features, per their std
    input_norm: bool = True  # False: EAGLE-1's layout (no norm before attention), exportable
    generation_batch: int = 32
    seed: int = 0
    resume: bool = False
    prompts: tuple[list, list] | None = None
    data: tuple[Path, ...] | None = None  # `specserve train data` sets, not the prompts
    data_tokens: int | None = None  # of the shards' training answer tokens (None: all)
    data_from: int | None = None  # leave out the shards' first N training answer tokens
    init_from: str | None = None  # a drafter directory (or "shipped") to train on from


def _batch(split: FeatureSplit, index: list[int], embed):
    """Padded tensors of sequences ``index``: tokens' embeddings [B, T, d], target features
    [B, T, d], the next token at each position [B, T] (-1 past the end), and the answer mask."""
    tokens = [torch.tensor(split.sequences[i]) for i in index]
    ids = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=-1)
    following = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], dim=1)
    batch, width = ids.shape
    embeddings = embed(ids.clamp_min(0).flatten()).float().reshape(batch, width, -1)
    features = padded([split.features[i] for i in index])
    return embeddings, features, following, answer_mask(split, index, width)


def _shift(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """x [B, T, ...] moved ``by`` positions later along T, zeros in front."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (by, 0))[:, : x.shape[1]]


def padded_rope(model):
    """``rope_of((batch, width))``: the rope factors of a padded [batch, width] batch, every
    row starting at position 0, flattened as the unrolled drafter takes them."""

    def rope_of(shape) -> torch.Tensor:
        batch, width = shape
        return model.rope.lookup(torch.arange(width).repeat(batch))

    return rope_of


CURVE_SAMPLE = 96  # held-out conversations the learning curve measures on


def _first(split: FeatureSplit, count: int) -> FeatureSplit:
    """The first ``count`` sequences of ``split``."""
    return FeatureSplit(
        split.sequences[:count], split.starts[:count], split.features[:count],
        None if split.spans is None else split.spans[:count],
    )  # fmt: skip


def unrolled_outputs(network: EagleNetwork, rope, embeddings, features, depth: int, noise=0.0):
    """The drafter's outputs at each depth 1..``depth``, [depth][B, T, d]: depth s at position
    p reads token p and the depth s - 1 output at p - 1 (the target's feature at depth 1), and
    attends to the depth-1 entries up to p - s + 1 plus the entry of each depth t at
    p - s + t (its own chain of guesses). ``features`` [B, T, d] is what depth 1 reads at each
    position (the target's feature, or another drafter input such as EAGLE-3's fused layers)."""
    batch, width, d = embeddings.shape
    s_ = network.shape
    heads, groups = s_["num_heads"], s_["num_heads"] // s_["num_kv_heads"]
    scale = s_["head_dim"] ** -0.5
    previous = _shift(features)
    if noise:
        previous = previous + torch.randn_like(previous) * noise * features.detach().std()
    keys, values, outputs = [], [], []
    for s in range(1, depth + 1):
        x, residual = network.entry(embeddings, previous)
        q, k, v = network.attention_inputs(x.reshape(batch * width, -1), rope)
        q = q.reshape(batch, width, heads, -1)
        k = k.repeat_interleave(groups, dim=1).reshape(batch, width, heads, -1)
        v = v.repeat_interleave(groups, dim=1).reshape(batch, width, heads, -1)
        keys.append(k)
        values.append(v)
        # Depth-1 entries at j <= p - s + 1 ...
        scores = torch.einsum("bphd,bjhd->bhpj", q, keys[0]) * scale
        seen = torch.ones(width, width, dtype=torch.bool).tril(-(s - 1))
        scores = scores.masked_fill(~seen, float("-inf"))
        # ... and depth t's entry at p - s + t, for t = 2 .. s (the last is the query's own).
        chain = [
            (q * _shift(keys[t - 1], s - t)).sum(-1).transpose(1, 2) * scale
            for t in range(2, s + 1)
        ]  # each [B, H, T]
        if chain:
            scores = torch.cat([scores, torch.stack(chain, dim=-1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)
        attended = torch.einsum("bhpj,bjhd->bphd", weights[..., :width], values[0])
        for i, t in enumerate(range(2, s + 1)):
            w = weights[..., width + i].transpose(1, 2)[..., None]  # [B, T, H, 1]
            attended = attended + w * _shift(values[t - 1], s - t)
        attended = attended.reshape(batch * width, heads, -1)
        out = network.finish(residual.reshape(batch * width, d), attended)
        out = out.reshape(batch, width, d)
        outputs.append(out)
        previous = _shift(out)
    return outputs


def _losses(outputs, features, readout, answer, regression: bool = True,
            head=None) -> list[torch.Tensor]:  # fmt: skip
    """Per depth, its weighted loss over the answer positions it can reach (depth s needs
    s - 1 earlier positions). Without ``regression``, distillation alone (EAGLE-3's loss).
    The teacher reads the target's final features through ``readout`` (its LM head's rows of
    the draft vocabulary); the drafter reads out through the same rows, or its own ``head``."""
    teacher = torch.softmax(features @ readout.T, dim=-1)
    head = head or (lambda out: out @ readout.T)
    results = []
    for s, out in enumerate(outputs, start=1):
        mask = answer.clone()
        mask[:, : s - 1] = False
        log_q = torch.log_softmax(head(out[mask]), dim=-1)
        distillation = -(teacher[mask] * log_q).sum(-1).mean()
        if regression:
            loss = (
                F.smooth_l1_loss(out[mask], features[mask]) + CLASSIFICATION_WEIGHT * distillation
            )
        else:
            loss = distillation
        results.append(loss * DEPTH_DECAY ** (s - 1))
    return results


@torch.no_grad()
def held_out_accuracies(*args, **kwargs) -> list[list[float]]:
    """[depth][i]: how often the i-th candidate at each depth is the target's next token
    (``held_out_counts``' arguments)."""
    return rates(held_out_counts(*args, **kwargs))


Counts = tuple[torch.Tensor, torch.Tensor]  # (hits [depth, top_k], positions seen [depth])


def rates(counts: Counts) -> list[list[float]]:
    """Hits over positions seen, per depth and candidate, from ``held_out_counts``."""
    hits, seen = counts
    return (hits / seen.clamp_min(1)[:, None]).tolist()


def held_out_counts(network, rope_of, split: FeatureSplit, embed, readout, vocab, vocab_size,
                    depth, top_k, batch=8, inputs_of=None, head=None,
                    only: list[int] | None = None) -> Counts:  # fmt: skip
    """(hits [depth, top_k], positions seen [depth]): how often the i-th candidate at each
    depth was the target's next token, and over how many positions (counts, so that scores
    of disjoint sequences add up). ``inputs_of(index, features)``: what depth 1 reads instead
    of the target's features; ``head``: the drafter's own readout instead of ``readout``'s
    rows; ``only``: these sequences of the split (default: all)."""
    head = head or (lambda out: out @ readout.T)
    hits = torch.zeros(depth, top_k)
    seen = torch.zeros(depth)
    # Readout row of each token; a token outside the draft vocabulary is a miss (row -2, never
    # a candidate), a position past the end is no label (-1, left out by the mask anyway).
    to_row = torch.full((vocab_size,), -2, dtype=torch.long)
    to_row[vocab] = torch.arange(len(vocab))
    chosen = list(range(len(split.sequences))) if only is None else list(only)
    for first in range(0, len(chosen), batch):
        index = chosen[first : first + batch]
        embeddings, features, following, answer = _batch(split, index, embed)
        rope = rope_of(features.shape[:2])
        reads = features if inputs_of is None else inputs_of(index, features)
        outputs = unrolled_outputs(network, rope, embeddings, reads, depth)
        wanted = to_row[following.clamp_min(0)]
        for s, out in enumerate(outputs, start=1):
            mask = answer.clone()
            mask[:, : s - 1] = False
            top = head(out[mask]).topk(top_k, dim=-1).indices
            hits[s - 1] += (top == wanted[mask][:, None]).sum(0).float()
            seen[s - 1] += mask.sum()
    return hits, seen


def run_train_eagle(llm, options: EagleTrainOptions) -> TrainedDrafter:
    from engine.toolkit import dense_weight

    run = TrainingRun()
    torch.manual_seed(options.seed)
    model = llm.engine.model
    arch = model.arch
    splits = training_splits(llm, options)
    train = splits["train"]
    labels = train.answer_labels()
    # (EAGLE's shape stores input_norm only when it is off.)
    wanted = {} if options.input_norm else {"input_norm": False}
    start = initial_drafter(options, "eagle", EagleNetwork, model, run, wanted)
    # EAGLE reads out through the target's rows: a warm start's grown vocabulary needs no head.
    size = options.draft_vocab_size
    vocab = (
        grown_vocabulary(start.draft_vocab, labels, size)
        if start
        else draft_vocabulary(labels, size)
    )
    covered = torch.isin(labels, vocab).float().mean().item()
    print(f"draft vocabulary: {len(vocab)} tokens, {covered:.1%} of training labels")
    readout = dense_weight(model.lm_head)[vocab].float()

    rope_of = padded_rope(model)
    network = start.network if start else EagleNetwork(
        arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
        arch.intermediate_size, arch.rms_norm_eps, input_norm=options.input_norm,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(network.parameters(), lr=options.learning_rate)

    def loss_of(index: list[int]) -> torch.Tensor:
        embeddings, features, _, answer = _batch(train, index, model.embed)
        outputs = unrolled_outputs(
            network, rope_of(features.shape[:2]), embeddings, features, options.depth,
            options.feature_noise,
        )  # fmt: skip
        return sum(_losses(outputs, features, readout, answer))

    held_out = splits["held_out"]
    sample = _first(held_out, CURVE_SAMPLE)
    def curve_point() -> list[float]:
        """Top-1 held-out accuracy per depth on a sample of the held-out split."""
        rows = held_out_accuracies(
            network, rope_of, sample, model.embed, readout, vocab, arch.vocab_size,
            options.depth, 1,
        )  # fmt: skip
        return [round(row[0], 4) for row in rows]

    after_step = curve_recorder(run, lambda b: sum(train.answer_tokens(i) for i in b), curve_point)

    train_epochs(
        network, optimizer, options, len(train.sequences), loss_of, 1.0, run, after_step
    )
    accuracies = by_answer_kind(
        lambda only: held_out_counts(
            network, rope_of, held_out, model.embed, readout, vocab, arch.vocab_size,
            options.depth, options.top_k, only=only,
        ),
        held_out,
    )  # fmt: skip
    print_accuracies_by_kind(accuracies)
    return write_drafter("eagle", network, vocab, accuracies, model, options, int(len(labels)), run)


def print_accuracies(accuracies: list[list[float]], what: str = "") -> None:
    """Held-out top-i accuracy per depth, and the accepted drafts a chain of each length
    should then get (the product of the depths' top-1 accuracies, summed)."""
    chain, expected = 1.0, 0.0
    for s, row in enumerate(accuracies, start=1):
        chain *= row[0]
        expected += chain
        print(f"held-out{what} depth {s}: top-i accuracy " + ", ".join(f"{a:.1%}" for a in row)
              + f"; expected accepted drafts of a {s}-token chain: {expected:.2f}")  # fmt: skip


def by_answer_kind(count, split: FeatureSplit) -> dict[str, list[list[float]]]:
    """Accuracies over the whole split and over each kind of answer it mixes, from
    ``count(only)`` (``held_out_counts`` over the sequences ``only``, None for all), each
    sequence scored once: the kinds partition the split, so all answers' counts are theirs
    added up. On greedy answers the next token is the target's argmax, so the accuracy there
    is what greedy decoding accepts; on sampled ones no drafter can match the sampled token
    more often than the target's argmax does."""
    kinds = split.answer_kinds()
    if len(kinds) <= 1:
        return {ALL_ANSWERS: rates(count(None))}
    counted = {kind: count(index) for kind, index in kinds.items()}
    hits = sum(c[0] for c in counted.values())
    seen = sum(c[1] for c in counted.values())
    return {ALL_ANSWERS: rates((hits, seen)), **{k: rates(c) for k, c in counted.items()}}


def print_accuracies_by_kind(accuracies: dict[str, list[list[float]]]) -> None:
    for kind, rows in accuracies.items():
        print_accuracies(rows, "" if kind == ALL_ANSWERS else f" ({kind})")


def evaluate_eagle(llm, drafter_dir: str | None, data: Path, depth: int = 3, top_k: int = 4):
    """Held-out top-i accuracy per depth of an EAGLE drafter (a directory, or the one shipped
    for the model) on the held-out split of a ``specserve train data`` set, over all its
    answers and by kind (``by_answer_kind``): drafters trained on different data compared on
    the same unseen conversations."""
    from engine.toolkit import dense_weight, load_drafter
    from tooling.training.shards import load_split

    model = llm.engine.model
    drafter = load_drafter(drafter_dir, "eagle", EagleNetwork, model)
    vocab = drafter.draft_vocab
    readout = dense_weight(model.lm_head)[vocab].float()

    rope_of = padded_rope(model)
    split = load_split(Path(data) / "held_out")
    return by_answer_kind(
        lambda only: held_out_counts(
            drafter.network.float(), rope_of, split, model.embed, readout, vocab,
            model.arch.vocab_size, depth, top_k, only=only,
        ),
        split,
    )  # fmt: skip
