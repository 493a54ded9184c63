"""What every ``specserve train`` kind shares around its own loss: the epochs (resume from the
checkpoint, a fresh shuffle per epoch, a progress bar with the running loss, a checkpoint after
every epoch) and writing the drafter directory with how it was trained."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.toolkit import TrainedDrafter, target_signature
from tooling.training.self_distillation import progress_bar

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainingRun:
    """The epochs a run trained, for the drafter's record."""

    first_epoch: int = 0  # the checkpoint's epoch when resumed, else 0
    epoch_losses: list[float] = field(default_factory=list)
    # (answer tokens trained on so far, held-out accuracies then), when the trainer keeps one.
    learning_curve: list[tuple[int, list]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


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
    ``options.resume`` it starts after the checkpoint in ``options.output``. ``after_step``
    is called with each batch's items once the optimizer has stepped on them."""
    run = run or TrainingRun()
    checkpoint = Path(options.output) / CHECKPOINT_FILE
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if options.resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        network.load_state_dict(state["network"] if "network" in state else state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        run.first_epoch = state["epoch"]
        print(f"resumed after epoch {run.first_epoch}")
    steps = (num_items + options.batch_size - 1) // options.batch_size
    for epoch in range(run.first_epoch, options.epochs):
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        with progress_bar(steps, f"epoch {epoch + 1}/{options.epochs}") as bar:
            for step in range(steps):
                batch = order[step * options.batch_size : (step + 1) * options.batch_size]
                loss = loss_of(batch.tolist())
                optimizer.zero_grad()
                loss.backward()
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(network.parameters(), clip_norm)
                optimizer.step()
                total += loss.item()
                if after_step is not None:
                    after_step(batch.tolist())
                bar.update()
                bar.set_postfix(loss=f"{total / (step + 1):.3f}")
        run.epoch_losses.append(round(total / steps, 4))
        torch.save(
            {"network": network.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": epoch + 1},
            checkpoint,
        )  # fmt: skip
    return run


def write_drafter(
    kind: str,
    network: nn.Module,
    vocab: torch.Tensor,
    accuracies: list[list[float]],
    model,
    options,
    num_answer_tokens: int,
    run: TrainingRun,
) -> TrainedDrafter:
    """The trained drafter, saved to ``options.output`` with how it was trained."""
    minutes = (time.monotonic() - run.started) / 60
    drafter = TrainedDrafter(
        kind,
        network,
        vocab,
        accuracies,
        target_signature(model),
        {
            "command": f"specserve train {kind}",
            "options": {k: str(v) for k, v in asdict(options).items() if k != "prompts"},
            "data": _data_description(options),
            "training_answer_tokens": num_answer_tokens,
            "resumed_after_epoch": run.first_epoch,
            "epoch_losses": run.epoch_losses,
            "learning_curve": run.learning_curve,
            "minutes": round(minutes, 1),
        },
    )
    drafter.save(options.output)
    print(f"drafter written to {options.output} ({minutes:.1f} min)")
    return drafter


def _data_description(options) -> str:
    if getattr(options, "data", None):
        return (
            f"the target's own conversations in {Path(options.data).name} "
            "(`specserve train data`: specserve's own requests, tooling/training/prompt_mix.py)"
        )
    return "answers of the target itself to specserve's own prompts (tooling/training/prompts.py)"
