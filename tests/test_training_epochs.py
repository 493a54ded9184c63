"""The epochs every trainer shares: checkpoints within an epoch that resume where they left
off, the learning-rate schedule, the precision of the passes, and the learning curve's points."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tooling.training import epochs
from tooling.training.epochs import (
    TrainingRun,
    chosen_precision,
    curve_recorder,
    learning_rate_at,
    train_epochs,
)


def _options(tmp_path, **overrides):
    values = dict(
        output=tmp_path, resume=False, batch_size=4, epochs=2, learning_rate=0.05,
        lr_schedule="cosine", precision="float32",
    )  # fmt: skip
    return SimpleNamespace(**(values | overrides))


def _problem():
    torch.manual_seed(0)
    inputs, targets = torch.randn(40, 6), torch.randn(40, 1)
    network = torch.nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(network.parameters(), lr=0.05)

    def loss_of(index):
        return torch.nn.functional.mse_loss(network(inputs[index]), targets[index])

    return network, optimizer, loss_of


class Interrupted(Exception):
    pass


def test_learning_rate_schedules():
    options = SimpleNamespace(learning_rate=0.01, lr_schedule="constant")
    assert learning_rate_at(options, 0.0) == learning_rate_at(options, 0.9) == 0.01
    options.lr_schedule = "cosine"
    assert learning_rate_at(options, 0.0) == pytest.approx(0.01)
    assert learning_rate_at(options, 0.5) == pytest.approx(0.005)
    assert learning_rate_at(options, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate_at(options, 0.25) == pytest.approx(0.005 * (1 + math.cos(math.pi / 4)))


def test_interrupted_within_an_epoch_resumes_to_the_same_network(tmp_path, monkeypatch):
    """Checkpoints within an epoch (every step here) let a run killed mid-epoch continue from
    the step after the last checkpoint and end where an unbroken run ends."""
    monkeypatch.setattr(epochs, "CHECKPOINT_SECONDS", -1.0)
    network, optimizer, loss_of = _problem()
    train_epochs(network, optimizer, _options(tmp_path / "whole"), 40, loss_of)
    whole = network.weight.detach().clone()

    network, optimizer, loss_of = _problem()
    calls = [0]

    def failing(index):
        calls[0] += 1
        if calls[0] == 14:  # epoch 2, step 4 of 10
            raise Interrupted
        return loss_of(index)

    with pytest.raises(Interrupted):
        train_epochs(network, optimizer, _options(tmp_path / "broken"), 40, failing)
    state = torch.load(tmp_path / "broken" / epochs.CHECKPOINT_FILE, weights_only=False)
    assert (state["epoch"], state["step"]) == (1, 3)

    network, optimizer, loss_of = _problem()  # a new process: fresh network and optimizer
    run = train_epochs(network, optimizer, _options(tmp_path / "broken", resume=True), 40, loss_of)
    assert run.first_epoch == 1
    assert torch.equal(network.weight.detach(), whole)


def test_cosine_schedule_reaches_the_optimizer(tmp_path):
    network, optimizer, loss_of = _problem()
    seen = []

    def recording(index):
        seen.append(optimizer.param_groups[0]["lr"])
        return loss_of(index)

    train_epochs(network, optimizer, _options(tmp_path, epochs=1), 40, recording)
    assert seen[0] == pytest.approx(0.05)
    assert all(a > b for a, b in zip(seen, seen[1:], strict=False))
    assert seen[-1] < 0.05 * 0.05


def test_bfloat16_precision_runs_the_passes_in_autocast(tmp_path):
    network, optimizer, loss_of = _problem()
    inside = []

    def recording(index):
        inside.append(torch.is_autocast_enabled("cpu"))
        return loss_of(index)

    train_epochs(network, optimizer, _options(tmp_path, precision="bfloat16"), 40, recording)
    assert inside and all(inside)
    assert network.weight.dtype == torch.float32  # the weights stay float32
    inside.clear()
    train_epochs(network, optimizer, _options(tmp_path / "f", precision="float32"), 40, recording)
    assert inside and not any(inside)


def test_auto_precision_times_both_and_leaves_no_gradient(tmp_path, capsys):
    network, _, loss_of = _problem()
    chosen = chosen_precision(network, _options(tmp_path, precision="auto"), loss_of, [0, 1, 2])
    assert chosen in ("float32", "bfloat16")
    assert all(p.grad is None for p in network.parameters())
    assert f"precision: {chosen}" in capsys.readouterr().out
    assert chosen_precision(network, _options(tmp_path, precision="float32"), None, []) == "float32"


def test_learning_curve_points_as_tokens_double_and_after_a_resume():
    run = TrainingRun()
    measured = []
    record = curve_recorder(run, lambda batch: sum(batch), lambda: measured.append(1) or [0.5])
    for batch in ([30_000], [30_000], [30_000], [30_000], [100_000]):
        record(batch)
    # 60k passes 50k, 120k passes 100k, 220k passes 200k: one point each, not per batch.
    assert [tokens for tokens, _ in run.learning_curve] == [60_000, 120_000, 220_000]
    resumed = TrainingRun(tokens_seen=run.tokens_seen)
    record = curve_recorder(resumed, lambda batch: sum(batch), lambda: [0.6])
    record([100_000])
    record([100_000])  # 420k passes 400k
    assert resumed.learning_curve == [(420_000, [0.6])]
