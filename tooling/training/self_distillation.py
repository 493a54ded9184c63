"""Self-distillation data: the target's own answers to our prompts, and its hidden states along
them.

A drafter is right when it guesses what the target would say next, so it learns from text the
target wrote: each prompt is answered by our engine (batched; greedy by default, as the
greedy output is what a lossless drafter must match most often), which also hands back the
target's last-layer hidden state at every position it ran; final-normed, those are the
features a feature-level drafter reads when drafting. (They used to come from a second,
teacher-forced pass over prompt + answer, which took longer than answering; that pass remains
for answers cached without their features, and for the hidden states of earlier layers.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.toolkit import (
    KVCache,
    SamplingParams,
    SequenceSlice,
    build_attention_metadata,
    rms_norm,
)


@dataclass
class Answers:
    """Token ids of prompt + answer per conversation, and where each answer starts; with the
    target's final-normed features along them when the generation captured them."""

    sequences: list[list[int]]
    answer_starts: list[int]
    features: list[torch.Tensor] | None = None  # per sequence [len, d], float16

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(s) - a for s, a in zip(self.sequences, self.answer_starts, strict=True))


def generate_answers(
    llm,
    prompts: list[str | list[int]],
    max_tokens: int,
    temperature: float,
    batch: int,
    progress=None,
    with_features: bool = False,
) -> Answers:
    """Answer each prompt with ``llm``, ``batch`` at a time: a text is a user message (the chat
    template applied), a list of token ids is the model's input as it is. ``with_features``
    keeps the target's features along each sequence, taken from the generation itself."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    model = llm.engine.model
    sequences, starts, features = [], [], []
    for first in range(0, len(prompts), batch):
        part = prompts[first : first + batch]
        inputs = [llm.render_chat([{"role": "user", "content": p}]) if isinstance(p, str) else p
                  for p in part]  # fmt: skip
        for out in llm.generate(inputs, params, return_hidden_states=with_features):
            sequences.append(list(out.prompt_token_ids) + list(out.token_ids))
            starts.append(len(out.prompt_token_ids))
            if with_features:
                features.append(final_features(model, out.outputs[0].hidden_states))
        if progress is not None:
            progress(len(part))
    return Answers(sequences, starts, features if with_features else None)


def final_features(model, hidden: torch.Tensor) -> torch.Tensor:
    """[len, d] float16 features of a sequence from the [len - 1, d] last-layer hidden states
    its generation fed through the model: final-normed, and zero at the last position, which
    never ran (no drafter reads it: it would be the input for a token past the end)."""
    normed = rms_norm(hidden.float(), model.final_norm.float(), model.arch.rms_norm_eps)
    return torch.cat([normed, normed.new_zeros(1, normed.shape[1])]).half()


ANSWERS_FILE = "answers.pt"


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="it", dynamic_ncols=True)


def cached_answers(llm, options, prompts: tuple[list, list]) -> dict[str, Answers]:
    """The target's answers to the (training, held-out) ``prompts``, from
    ``options.output / answers.pt`` when it holds answers made with the same options (the
    slow part of training: every drafter kind of one model can share them)."""
    path = Path(options.output) / ANSWERS_FILE
    wanted = {k: getattr(options, k) for k in ("num_prompts", "num_held_out", "max_tokens")}
    wanted |= {"temperature": options.temperature, "seed": options.seed}
    wanted |= {"prompts": options.prompts}
    if path.is_file():
        cached = torch.load(path, weights_only=False)
        if cached["options"] == wanted:
            print(f"answers: cached in {path}")
            return cached["answers"]
    answers, splits = {}, {}
    for split, texts in zip(("train", "held_out"), prompts, strict=True):
        with progress_bar(len(texts), f"{split}: answering") as bar:
            a = generate_answers(
                llm, texts, options.max_tokens, options.temperature, options.generation_batch,
                bar.update, with_features=True,
            )  # fmt: skip
        answers[split] = Answers(a.sequences, a.answer_starts)
        splits[split] = FeatureSplit(a.sequences, a.answer_starts, a.features)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"options": wanted, "answers": answers}, path)
    torch.save(splits, path.with_name(FEATURES_FILE))  # what cached_features looks for
    return answers


@torch.inference_mode()
def sequence_features(
    model, sequences: list[list[int]], batch_tokens: int = 4096, progress=None, layer=None
):
    """Per sequence, [len, d] final-normed last-layer hidden states at every position, in
    teacher-forced passes of up to ``batch_tokens`` tokens; with ``layer``, the raw hidden
    states after that layer instead (only the layers up to it run), or with a tuple of
    layers, theirs side by side ([len, layers * d], EAGLE-3's inputs)."""
    arch = model.arch
    block = 16
    out: list[torch.Tensor] = []
    order = list(range(len(sequences)))
    while order:
        group, total = [], 0
        while order and (not group or total + len(sequences[order[0]]) <= batch_tokens):
            group.append(order.pop(0))
            total += len(sequences[group[-1]])
        blocks = [(len(sequences[i]) + block - 1) // block for i in group]
        geometry = (arch.num_layers, sum(blocks), block, arch.num_kv_heads, arch.head_dim)
        cache = KVCache(*geometry, model.dtype, "cpu")
        slices, ids, positions, first_block = [], [], [], 0
        for i, nb in zip(group, blocks, strict=True):
            tokens = sequences[i]
            slices.append(SequenceSlice(0, len(tokens), list(range(first_block, first_block + nb))))
            ids += tokens
            positions += range(len(tokens))
            first_block += nb
        meta = build_attention_metadata(slices, block, arch.head_dim, "cpu", arch.sliding_window)
        hidden = model(
            torch.tensor(ids),
            torch.tensor(positions),
            cache.layers,
            meta,
            layer_ids=None if layer is None or isinstance(layer, tuple) else range(layer + 1),
            hidden_layer=arch.num_layers - 1 if layer is None else layer,
            compute_logits=False,
            all_hidden=True,
        ).hidden_states.float()
        if layer is None:
            hidden = rms_norm(hidden, model.final_norm.float(), arch.rms_norm_eps)
        out += list(hidden.split([len(sequences[i]) for i in group]))
        if progress is not None:
            progress(len(group))
    return out


FEATURES_FILE = "features.pt"
ALL_ANSWERS = "all answers"  # the key of a split's whole held-out score beside its kinds'


@dataclass(frozen=True)
class SplitSource:
    """``count`` consecutive sequences of a split: the conversations ``first`` ..
    ``first + count - 1`` of a shard directory, in its shards' order."""

    directory: Path
    first: int
    count: int


@dataclass
class FeatureSplit:
    """Sequences with the target's final-normed features at every position, and where each
    answer starts; with ``spans``, the [start, end) of each of the target's turns instead (a
    conversation of several turns)."""

    sequences: list[list[int]]
    starts: list[int]
    features: list[torch.Tensor]  # per sequence [len, d], float16
    spans: list[list[tuple[int, int]]] | None = None
    # Where the sequences lie in shard directories, in order (none: not from shards): what
    # the per-shard caches beside the shards (``layer_cache``) are read by.
    sources: list[SplitSource] = field(default_factory=list)
    # Per sequence, the temperature its answers were sampled at (0: greedy); None: not known.
    temperatures: list[float] | None = None

    def answer_kinds(self) -> dict[str, list[int]]:
        """Sequence indices by how their answers were made: greedy answers, whose every token
        is the target's own argmax (a drafter's accuracy on them is its greedy acceptance),
        and sampled ones, whose tokens a drafter can match only as often as the target's
        argmax does. Empty without temperatures."""
        if self.temperatures is None:
            return {}
        kinds = {"greedy answers": [], "sampled answers": []}
        for i, t in enumerate(self.temperatures):
            kinds["greedy answers" if t == 0 else "sampled answers"].append(i)
        return {kind: index for kind, index in kinds.items() if index}

    def answer_spans(self, i: int) -> list[tuple[int, int]]:
        """[start, end) of sequence ``i``'s answer tokens, turn by turn."""
        if self.spans is not None:
            return self.spans[i]
        return [(self.starts[i], len(self.sequences[i]))]

    def answer_labels(self) -> torch.Tensor:
        """Every answer token of the split, in order (what the draft vocabulary is cut from)."""
        return torch.cat([
            torch.tensor(seq[a:b]) for i, seq in enumerate(self.sequences)
            for a, b in self.answer_spans(i)
        ])  # fmt: skip

    def answer_tokens(self, i: int) -> int:
        return sum(b - a for a, b in self.answer_spans(i))


def joined(splits: list[FeatureSplit]) -> FeatureSplit:
    """One split of several (data sets learnt from together), in order."""
    if len(splits) == 1:
        return splits[0]
    known = all(s.temperatures is not None for s in splits)
    return FeatureSplit(
        [q for s in splits for q in s.sequences],
        [a for s in splits for a in s.starts],
        [f for s in splits for f in s.features],
        [s.answer_spans(i) for s in splits for i in range(len(s.sequences))],
        [source for s in splits for source in s.sources],
        [t for s in splits for t in s.temperatures] if known else None,
    )


def cached_features(llm, options, answers: dict[str, Answers]) -> dict[str, FeatureSplit]:
    """The features along ``answers``, from ``options.output / features.pt`` when it holds
    those of the same sequences (a teacher-forced pass over every token takes minutes)."""
    path = Path(options.output) / FEATURES_FILE
    if path.is_file():
        cached = torch.load(path, weights_only=False)
        if all(cached[k].sequences == answers[k].sequences for k in answers):
            print(f"features: cached in {path}")
            return cached
    splits = {}
    for split, a in answers.items():
        with progress_bar(len(a.sequences), f"{split}: features") as bar:
            features = sequence_features(llm.engine.model, a.sequences, progress=bar.update)
        splits[split] = FeatureSplit(a.sequences, a.answer_starts, [f.half() for f in features])
    torch.save(splits, path)
    return splits


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, T, ...] from per-sequence [len, ...] tensors, zeros past each one's end."""
    return torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)


def answer_mask(split: FeatureSplit, index: list[int], width: int) -> torch.Tensor:
    """[B, T] bool: the positions whose next token is an answer token."""
    mask = torch.zeros(len(index), width, dtype=torch.bool)
    for b, i in enumerate(index):
        for start, end in split.answer_spans(i):
            mask[b, start - 1 : end - 1] = True
    return mask


def answer_features(split: FeatureSplit):
    """[rows, d] features (as stored), with each row's sequence index and position: one row
    per position from each answer's last prompt token to its second-to-last token (the
    positions whose next token is an answer token)."""
    features, owners, where = [], [], []
    for i in range(len(split.sequences)):
        for start, end in split.answer_spans(i):
            features.append(split.features[i][start - 1 : end - 1])
            owners += [i] * (end - start)
            where += range(start - 1, end - 1)
    return torch.cat(features), torch.tensor(owners), torch.tensor(where)
