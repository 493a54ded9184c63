"""What every ``specserve train`` kind shares around its own loss: the epochs (resume from the
checkpoint, a fresh shuffle per epoch, a progress bar with the running loss, a checkpoint after
every epoch) and writing the drafter directory with how it was trained."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.toolkit import TrainedDrafter, target_signature
from tooling.training.self_distillation import ALL_ANSWERS, progress_bar

CHECKPOINT_FILE = "checkpoint.pt"
CURVE_START = 50_000  # answer tokens at the learning curve's first point; then doubling


CHECKPOINT_SECONDS = 600  # also within an epoch: a pass over millions of tokens takes hours


@dataclass
class TrainingRun:
    """The epochs a run trained, for the drafter's record."""

    first_epoch: int = 0  # the checkpoint's epoch when resumed, else 0
    epoch_losses: list[float] = field(default_factory=list)
    # (answer tokens trained on so far, held-out accuracies then), when the trainer keeps one.
    learning_curve: list[tuple[int, list]] = field(default_factory=list)
    tokens_seen: int = 0  # answer tokens of the batches stepped on, for the learning curve
    # The drafter an --init-from run started from, and how much that one had learnt from.
    started_from: dict | None = None
    started: float = field(default_factory=time.monotonic)


def learning_rate_at(options, progress: float) -> float:
    """The learning rate ``progress`` (0 to 1) of the way through the run: constant, or cosine
    decay to zero (``options.lr_schedule``), which ends a run on a settled network."""
    base = options.learning_rate
    if options.lr_schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return base


def _autocast(network: nn.Module, precision: str):
    device = next(network.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def chosen_precision(network: nn.Module, options, loss_of, batch: list[int]) -> str:
    """The precision the batches' passes run in: ``options.precision``, or for "auto" the
    faster on this machine of float32 and bfloat16 autocast (weights, optimizer and held-out
    measurements stay float32), timed on one batch: bfloat16 is 3.3x on a Zen 5 with
    AVX512-BF16 and can lose where the CPU has no bfloat16 arithmetic."""
    if options.precision != "auto":
        return options.precision
    seconds = {}
    for precision in ("float32", "bfloat16", "float32", "bfloat16"):  # the first two: warm-up
        started = time.perf_counter()
        with _autocast(network, precision):
            loss = loss_of(batch)
        loss.backward()
        seconds[precision] = time.perf_counter() - started
    network.zero_grad(set_to_none=True)
    # Only a clear win: bfloat16 rounds the activations.
    chosen = "bfloat16" if seconds["bfloat16"] * 1.2 < seconds["float32"] else "float32"
    print(
        f"precision: {chosen} (a batch took {seconds['float32'] * 1000:.0f} ms in float32, "
        f"{seconds['bfloat16'] * 1000:.0f} ms in bfloat16 autocast)"
    )
    return chosen


def train_epochs(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    options,
    num_items: int,
    loss_of: Callable[[list[int]], torch.Tensor],
    clip_norm: float | None = None,
    run: TrainingRun | None = None,
    after_step: Callable[[list[int]], None] | None = None,
) -> TrainingRun:
    """``options.epochs`` epochs over ``num_items`` items in batches of ``options.batch_size``
    (shuffled per epoch with the epoch as seed); ``loss_of(indices)`` is a batch's loss. With
    ``options.resume`` it continues from the checkpoint in ``options.output``, written after
    every epoch and every ``CHECKPOINT_SECONDS`` within one. ``after_step`` is called with each
    batch's items once the optimizer has stepped on them."""
    run = run or TrainingRun()
    checkpoint = Path(options.output) / CHECKPOINT_FILE
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    first_step = 0
    if options.resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        network.load_state_dict(state["network"] if "network" in state else state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        run.first_epoch, first_step = state["epoch"], state.get("step", 0)
        run.tokens_seen = state.get("tokens_seen", 0)
        run.learning_curve = [tuple(point) for point in state.get("learning_curve", [])]
        within = f", step {first_step}" if first_step else ""
        print(f"resumed after epoch {run.first_epoch}{within}")
    steps = (num_items + options.batch_size - 1) // options.batch_size
    first = torch.randperm(num_items, generator=torch.Generator().manual_seed(0))
    precision = chosen_precision(network, options, loss_of, first[: options.batch_size].tolist())

    def save(epoch: int, step: int) -> None:
        state = {
            "network": network.state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": epoch, "step": step, "tokens_seen": run.tokens_seen,
            "learning_curve": run.learning_curve,
        }  # fmt: skip
        partial = checkpoint.with_suffix(".partial")
        torch.save(state, partial)
        partial.replace(checkpoint)  # whole or the previous one: an interrupted save loses nothing

    for epoch in range(run.first_epoch, options.epochs):
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(epoch))
        total, done, saved = 0.0, 0, time.monotonic()
        start = first_step if epoch == run.first_epoch else 0
        with progress_bar(steps, f"epoch {epoch + 1}/{options.epochs}") as bar:
            bar.update(start)
            for step in range(start, steps):
                lr = learning_rate_at(options, (epoch * steps + step) / (options.epochs * steps))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = order[step * options.batch_size : (step + 1) * options.batch_size]
                with _autocast(network, precision):
                    loss = loss_of(batch.tolist())
                optimizer.zero_grad()
                loss.backward()
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(network.parameters(), clip_norm)
                optimizer.step()
                total, done = total + loss.item(), done + 1
                if after_step is not None:
                    after_step(batch.tolist())
                bar.update()
                bar.set_postfix(loss=f"{total / done:.3f}")
                if time.monotonic() - saved > CHECKPOINT_SECONDS and step + 1 < steps:
                    save(epoch, step + 1)
                    saved = time.monotonic()
        run.epoch_losses.append(round(total / max(done, 1), 4))
        save(epoch + 1, 0)
    return run


def curve_recorder(
    run: TrainingRun, answer_tokens: Callable[[list[int]], int], measure: Callable[[], list]
) -> Callable[[list[int]], None]:
    """An ``after_step`` keeping the learning curve (as EAGLE's): ``measure()`` (held-out top-1
    by depth) each time the answer tokens trained on pass ``CURVE_START`` times a power of 2."""

    def after_step(batch: list[int]) -> None:
        before = run.tokens_seen
        run.tokens_seen += answer_tokens(batch)
        milestone = CURVE_START
        while milestone <= before:
            milestone *= 2
        if run.tokens_seen < milestone:
            return
        top1 = measure()
        run.learning_curve.append((run.tokens_seen, top1))
        print(f"\nafter {run.tokens_seen:,} answer tokens: held-out top-1 by depth {top1}")

    return after_step


def write_drafter(
    kind: str,
    network: nn.Module,
    vocab: torch.Tensor,
    accuracies: list[list[float]] | dict[str, list[list[float]]],
    model,
    options,
    num_answer_tokens: int,
    run: TrainingRun,
) -> TrainedDrafter:
    """The trained drafter, saved to ``options.output`` with how it was trained.
    ``accuracies``: held-out top-i per depth, or those by answer kind (``by_answer_kind``:
    the drafter keeps all answers', the record each kind's top-1)."""
    minutes = (time.monotonic() - run.started) / 60
    by_kind = accuracies if isinstance(accuracies, dict) else {}
    if by_kind:
        accuracies = by_kind[ALL_ANSWERS]
    drafter = TrainedDrafter(
        kind,
        network,
        vocab,
        accuracies,
        target_signature(model),
        {
            "command": f"specserve train {kind}",
            "options": {k: _option_text(v) for k, v in asdict(options).items() if k != "prompts"},
            "data": _data_description(options),
            "training_answer_tokens": num_answer_tokens,
            "resumed_after_epoch": run.first_epoch,
            **({"started_from": run.started_from} if run.started_from else {}),
            "epoch_losses": run.epoch_losses,
            "learning_curve": run.learning_curve,
            **_top1_by_kind(by_kind),
            "minutes": round(minutes, 1),
        },
    )
    drafter.save(options.output)
    print(f"drafter written to {options.output} ({minutes:.1f} min)")
    return drafter


def _top1_by_kind(by_kind: dict[str, list[list[float]]]) -> dict:
    """The record's held-out top-1 per depth by answer kind, where the split mixes kinds."""
    if len(by_kind) < 2:
        return {}
    top1 = {kind: [round(row[0], 4) for row in rows] for kind, rows in by_kind.items()}
    return {"held_out_top1_by_answer_kind": top1}


def _option_text(value) -> str:
    """An option as the record keeps it; several paths (--data) comma-separated."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Path) for v in value):
        return ",".join(str(v) for v in value)
    return str(value)


def _data_description(options) -> str:
    from tooling.training.data import data_paths

    paths = data_paths(options)
    if paths:
        return "; ".join(_set_description(path) for path in paths)
    return "answers of the target itself to specserve's own prompts (tooling/training/prompts.py)"


def _set_description(path: Path) -> str:
    """What a data set named by --data holds: specserve's own requests or a file's."""
    recipe = path / "recipe.json"
    source = json.loads(recipe.read_text()).get("source") if recipe.is_file() else None
    if source or not path.is_dir():
        name = source["file"] if source else path.name
        return f"the target's answers to the conversations of {name} (`train data --from`)"
    return (
        f"the target's own conversations in {path.name} "
        "(`specserve train data`: specserve's own requests, tooling/training/prompt_mix.py)"
    )
