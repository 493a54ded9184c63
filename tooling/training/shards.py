"""The self-distillation set at scale: conversations the target has with our requests, written
in resumable shards.

A shard is ``shard_requests`` requests (``prompt_mix``) each answered ``answers_per_request``
times (the first greedily, the rest sampled at the recipe's temperatures, each with its own
seed), a share of them continued by a follow-up turn that the target answers too. Along each
conversation it keeps the token ids, where the assistant's turns are, and the target's
final-normed features at every position, captured from the generating passes themselves.

With ``keep_layers`` the same passes also keep the outputs of those layers (EAGLE-3's low,
middle and high layer), written beside the shard where ``layer_cache`` reads them, so training
an EAGLE-3 drafter needs no second, teacher-forced pass over the data.

Every shard is a function of the recipe and its index alone, so an interrupted build continues
where it stopped and makes the same data: a shard is written to a temporary name and renamed
when complete, and a rerun skips the shards that exist. The build stops once the training split
holds the token budget's answer tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from engine.toolkit import SamplingParams
from tooling.training.prompt_mix import Request, request
from tooling.training.self_distillation import FeatureSplit, SplitSource, final_features

RECIPE_FILE = "recipe.json"
GENERATOR_VERSION = 1  # bump when prompt_mix or the shard layout changes what a shard holds


@dataclass(frozen=True)
class Recipe:
    """What the shards of one data set are made from; a rerun must use the same."""

    target: dict
    seed: int = 0
    shard_requests: int = 128
    answers_per_request: int = 2
    temperatures: tuple[float, ...] = (0.7, 1.0)  # of the sampled answers, in turn
    max_tokens: int = 384
    follow_up_max_tokens: int = 256
    follow_up_share: float = 0.25
    generator_version: int = GENERATOR_VERSION
    # Where the requests come from: None, specserve's own generator (prompt_mix); else a
    # user's conversations file (its name, sha256 and how many conversations it holds).
    source: dict | None = None
    # The target's numerics where they make another model than the exact float32 one
    # (``numerics_of``); None: float32. Answers in 8-bit activations or bfloat16 are another
    # model's, so a set must not go on in other numerics than it began in.
    numerics: dict | None = None

    def temperature(self, answer: int) -> float:
        if answer == 0:
            return 0.0
        return self.temperatures[(answer - 1) % len(self.temperatures)]


@dataclass
class Conversation:
    """Token ids of one conversation, the [start, end) spans of the target's turns in it, and
    the target's final-normed features along it ([len, d] float16)."""

    tokens: list[int]
    spans: list[tuple[int, int]]
    features: torch.Tensor
    temperature: float = 0.0
    layers: torch.Tensor | None = None  # [len, layers * d] float16, with keep_layers


    @property
    def answer_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass
class ShardIndex:
    """The small sidecar of a shard: what a resuming build counts without loading it."""

    conversations: int
    answer_tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)


def _seed(*parts) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def shard_requests(recipe: Recipe, split: str, index: int) -> list[Request]:
    rng = random.Random(_seed(recipe.seed, split, index))
    return [request(rng, split, recipe.follow_up_share) for _ in range(recipe.shard_requests)]


def make_shard(llm, recipe: Recipe, split: str, index: int) -> list[Conversation]:
    """Shard ``index`` of ``split``: the target's conversations with its requests."""
    return converse(llm, recipe, shard_requests(recipe, split, index), (split, index))


def converse(llm, recipe: Recipe, requests: list[Request], where: tuple,
             keep_layers: tuple[int, ...] | None = None) -> list[Conversation]:  # fmt: skip
    """The target's conversations with ``requests``, ``recipe.answers_per_request`` each, all
    batched turn by turn: each user turn after the first follows the target's own complete
    answer to the one before (a conversation whose answer ran out of tokens ends there).
    ``where`` names the batch in the seeds, so each answer has its own; ``keep_layers``
    keeps those layers' outputs along each conversation too."""
    last = llm.engine.model.arch.num_layers - 1
    capture = True if keep_layers is None else (*keep_layers, last)
    owners = [(r, a) for r in range(len(requests)) for a in range(recipe.answers_per_request)]
    conversations: list[Conversation | None] = [None] * len(owners)
    endings: list[str | None] = [None] * len(owners)
    for turn in range(1, max(len(q.user_turns) for q in requests) + 1):
        prompts, params, which = [], [], []
        for i, (r, a) in enumerate(owners):
            user_turns = requests[r].user_turns
            if turn > len(user_turns) or (turn > 1 and endings[i] != "stop"):
                continue
            if turn == 1:
                prompts.append(llm.render_chat(requests[r].opening()))
            else:
                next_turn = _user_turn(llm, user_turns[turn - 1])
                prompts.append(_continued(conversations[i].tokens, next_turn))
            limit = recipe.max_tokens if turn == 1 else recipe.follow_up_max_tokens
            params.append(_params(recipe, a, limit, *where, r, turn))
            which.append(i)
        if not prompts:
            break
        outputs = llm.generate(prompts, params, return_hidden_states=capture)
        for i, out in zip(which, outputs, strict=True):
            conversation = _conversation(llm, out, recipe.temperature(owners[i][1]), keep_layers)
            if conversations[i] is not None:
                conversation.spans = conversations[i].spans + conversation.spans
            conversations[i] = conversation
            endings[i] = out.outputs[0].finish_reason
    return conversations


def _params(recipe: Recipe, answer: int, max_tokens: int, *where) -> SamplingParams:
    return SamplingParams(
        temperature=recipe.temperature(answer),
        max_tokens=max_tokens,
        seed=_seed(recipe.seed, *where, answer),
    )


def _conversation(llm, out, temperature: float,
                  keep_layers: tuple[int, ...] | None) -> Conversation:  # fmt: skip
    prompt, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    model = llm.engine.model
    hidden, layers = out.outputs[0].hidden_states, None
    if keep_layers is not None:  # the kept layers' columns, then the last layer's
        cut = len(keep_layers) * model.arch.hidden_size
        # zero at the last position, which never ran (as final_features)
        layers = torch.cat([hidden[:, :cut], hidden.new_zeros(1, cut)]).half()
        hidden = hidden[:, cut:]
    features = final_features(model, hidden)
    tokens = prompt + answer
    return Conversation(tokens, [(len(prompt), len(tokens))], features, temperature, layers)


def _user_turn(llm, message: str) -> list[int]:
    """The tokens that close the assistant's turn (where the answer did not) and open the
    user's next one and the assistant's reply to it, as the chat template writes them."""
    one = llm.render_chat([{"role": "user", "content": "x"}])
    two = llm.render_chat(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": message},
        ]
    )
    # ``two`` = ``one`` + "y" + end of turn + the next user turn and the assistant's opening.
    y = llm.tokenizer.encode("y", add_special_tokens=False)
    if two[: len(one)] != one or two[len(one) : len(one) + len(y)] != y:
        raise ValueError("the chat template does not extend a conversation by appending")
    return two[len(one) + len(y) :]


def _continued(tokens: list[int], turn: list[int]) -> list[int]:
    """``tokens`` followed by the next ``turn``, without doubling the end-of-turn token that
    a stopped answer already ends with."""
    if turn and tokens and tokens[-1] == turn[0]:
        return tokens + turn[1:]
    return tokens + turn


def layer_directory(split: Path, layers: tuple[int, ...]) -> Path:
    """Where the kept outputs of ``layers`` lie beside a split's shards (one file per shard,
    named as the shard: a list of [len, layers * d] float16, one per conversation)."""
    return Path(split) / ("layers-" + "-".join(str(i) for i in layers))


def kept_layers_with(split: Path, layer: int) -> tuple[int, ...] | None:
    """A set of kept layers beside the split's shards that holds ``layer``'s outputs for
    every shard (None if no set does), so a drafter that reads that layer needs no pass."""
    shards = [p.name for p in shard_paths(Path(split))]
    for kept in sorted(Path(split).glob("layers-*")):
        try:
            layers = tuple(int(i) for i in kept.name.removeprefix("layers-").split("-"))
        except ValueError:
            continue  # not a directory this module made
        if layer in layers and shards and all((kept / name).is_file() for name in shards):
            return layers
    return None


def save_layer_rows(split: Path, layers: tuple[int, ...], shard: str, rows: list[torch.Tensor]):
    kept = layer_directory(split, layers)
    kept.mkdir(parents=True, exist_ok=True)
    partial = (kept / shard).with_suffix(".partial")
    torch.save(rows, partial)
    os.replace(partial, kept / shard)  # whole or absent: an interrupted run recomputes it


def save_shard(directory: Path, index: int, conversations: list[Conversation], seconds: float,
               keep_layers: tuple[int, ...] | None = None):  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-{index:05d}.pt"
    if keep_layers is not None:  # before the shard, which exists only once all of it does
        save_layer_rows(directory, keep_layers, path.name, [c.layers for c in conversations])
    payload = {
        "tokens": [torch.tensor(c.tokens, dtype=torch.int32) for c in conversations],
        "spans": [c.spans for c in conversations],
        "features": [c.features for c in conversations],
        "temperatures": [c.temperature for c in conversations],
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tokens = sum(c.answer_tokens for c in conversations)
    sidecar = ShardIndex(len(conversations), tokens, round(seconds, 1))
    path.with_suffix(".json").write_text(json.dumps(asdict(sidecar)))
    tmp.rename(path)  # last: a shard exists only once it is whole


def load_shard(path: Path) -> list[Conversation]:
    # Mapped, not read: a set of millions of tokens outgrows memory (5M answer tokens' features
    # take 6.5 GB, and EAGLE-3's layers 21 GB more); the page cache keeps what fits.
    data = torch.load(path, weights_only=True, mmap=True)
    return [
        Conversation(t.tolist(), [tuple(s) for s in spans], f, temp)
        for t, spans, f, temp in zip(
            data["tokens"], data["spans"], data["features"], data["temperatures"], strict=True
        )
    ]


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("shard-*.pt"))


def answer_tokens_in(directory: Path) -> int:
    return sum(
        json.loads(p.with_suffix(".json").read_text())["answer_tokens"]
        for p in shard_paths(directory)
    )


def check_recipe(root: Path, recipe: Recipe) -> None:
    """Write the recipe of a new data set, or refuse to extend one made with another."""
    path = root / RECIPE_FILE
    # Unset fields are left out, so data made before a field existed still matches.
    wanted = {k: v for k, v in json.loads(json.dumps(asdict(recipe))).items() if v is not None}
    if path.is_file():
        found = {k: v for k, v in json.loads(path.read_text()).items() if v is not None}
        if found != wanted:
            keys = wanted.keys() | found.keys()
            changed = sorted(k for k in keys if found.get(k) != wanted.get(k))
            raise ValueError(
                f"{root} holds data made with another recipe (differs in {', '.join(changed)}); "
                "use another --output or the same options"
            )
        return
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2))


def build(llm, root: Path, recipe: Recipe, budget: int, held_out_shards: int = 1,
          progress=None, keep_layers: tuple[int, ...] | None = None,
          first_shard: int = 0) -> int:  # fmt: skip
    """Shards of specserve's own requests under ``root``/train until they hold ``budget``
    answer tokens, and ``held_out_shards`` under ``root``/held_out (on subjects training
    never sees); returns the training split's answer tokens. Training shards are made from
    index ``first_shard`` on: each index draws its own requests, so a set can go on past
    shards a drafter already learned from without making them again."""

    def requests_of(split: str, index: int) -> list[Request] | None:
        if split == "held_out" and index >= held_out_shards:
            return None
        return shard_requests(recipe, split, index)

    return _build(llm, root, recipe, budget, requests_of, progress, keep_layers, first_shard)


def build_from_file(llm, path: Path, root: Path, recipe: Recipe, budget: int,
                    held_out: int | None = None, progress=None,
                    keep_layers: tuple[int, ...] | None = None) -> int:  # fmt: skip
    """Shards of the conversations in a JSONL file (``conversations_file``) under ``root``:
    the last ``held_out`` conversations held out (None: 5%, 1 to 64), the others for
    training, in order, until the file ends or the training split holds ``budget`` answer
    tokens."""
    from tooling.training.conversations_file import read_conversations

    found = read_conversations(path)
    print(f"{path}: {found.summary()}")
    requests = found.requests
    if held_out is None:
        held_out = max(1, min(64, len(requests) // 20))
    if len(requests) <= held_out:
        raise ValueError(f"{path}: {len(requests)} conversations, need more than {held_out}")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    source = {"file": Path(path).name, "sha256": digest, "conversations": len(requests)}
    recipe = replace(recipe, source=source)
    cut = len(requests) - held_out
    parts = {"train": requests[:cut], "held_out": requests[cut:]}
    size = recipe.shard_requests

    def requests_of(split: str, index: int) -> list[Request] | None:
        return parts[split][index * size : (index + 1) * size] or None

    return _build(llm, root, recipe, budget, requests_of, progress, keep_layers)


def _build(llm, root: Path, recipe: Recipe, budget: int, requests_of, progress,
           keep_layers: tuple[int, ...] | None, first_shard: int = 0) -> int:  # fmt: skip
    check_recipe(root, recipe)
    index = 0
    while (requests := requests_of("held_out", index)) is not None:
        _ensure_shard(llm, root / "held_out", recipe, "held_out", index, requests, keep_layers)
        index += 1
    done = answer_tokens_in(root / "train")
    if progress is not None:
        progress(done)
    index = first_shard
    while done < budget and (requests := requests_of("train", index)) is not None:
        made = _ensure_shard(llm, root / "train", recipe, "train", index, requests, keep_layers)
        index += 1
        if made:
            done += made
            if progress is not None:
                progress(made)
    return done


def _ensure_shard(llm, directory: Path, recipe: Recipe, split: str, index: int,
                  requests: list[Request], keep_layers: tuple[int, ...] | None) -> int:  # fmt: skip
    """Make shard ``index`` unless it exists; the answer tokens it added (0 if it existed).
    (An existing shard's layers are not made here: ``layer_cache`` computes those it lacks.)"""
    if (directory / f"shard-{index:05d}.pt").is_file():
        return 0
    started = time.perf_counter()
    conversations = converse(llm, recipe, requests, (split, index), keep_layers)
    save_shard(directory, index, conversations, time.perf_counter() - started, keep_layers)
    return sum(c.answer_tokens for c in conversations)


def load_split(directory: Path, max_answer_tokens: int | None = None, skip_answer_tokens: int = 0):
    """The conversations of ``directory``'s shards as a ``FeatureSplit``, in shard order, up to
    ``max_answer_tokens`` answer tokens counted from the first shard (whole conversations;
    None: all), leaving out those that start within the first ``skip_answer_tokens`` (data a
    drafter continued with ``--init-from`` has already seen)."""
    paths = shard_paths(Path(directory))
    if not paths:
        raise ValueError(f"{directory}: no shards (make them with `specserve train data`)")
    split = FeatureSplit([], [], [], [], temperatures=[])
    total = first = 0
    for path in paths:
        for c in load_shard(path):
            if max_answer_tokens is not None and total >= max_answer_tokens:
                return _sourced(split, directory, first)
            if total < skip_answer_tokens:
                total += c.answer_tokens
                first += 1
                continue
            split.sequences.append(c.tokens)
            split.starts.append(c.spans[0][0])
            split.features.append(c.features)
            split.spans.append(c.spans)
            split.temperatures.append(c.temperature)
            total += c.answer_tokens
    return _sourced(split, directory, first)


def _sourced(split: FeatureSplit, directory: Path, first: int) -> FeatureSplit:
    split.sources = [SplitSource(Path(directory), first, len(split.sequences))]
    return split


def default_root(model_dir: Path, conversations: Path | None = None) -> Path:
    """Where a model's data set lives in the cache: its own requests' set, or one per
    conversations file (by name and content)."""
    from engine.toolkit import cache_dir

    base = cache_dir() / "training-data" / Path(str(model_dir)).name
    if conversations is None:
        return base
    digest = hashlib.sha256(Path(conversations).read_bytes()).hexdigest()[:12]
    return base.with_name(f"{base.name}-{Path(conversations).stem}-{digest}")


def numerics_of(config) -> dict | None:
    """What of an engine config changes the model that answers (None: exact float32).
    Batch invariance and the device change at most last bits: left out, so a set begun on
    one machine can go on on another."""
    numerics = {}
    if config.int8_activations:
        numerics["int8_activations"] = True
    if config.dtype != "float32":
        numerics["dtype"] = config.dtype
    return numerics or None


def recipe_for(llm, **options) -> Recipe:
    """A recipe for ``llm``'s model (its shape and directory name identify it) in the
    numerics it runs in."""
    from engine.toolkit import target_signature

    name = Path(str(llm.model_dir)).name
    target = target_signature(llm.engine.model) | {"model": name}
    return Recipe(target=target, numerics=numerics_of(llm.config), **options)
