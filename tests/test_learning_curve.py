"""The learning-curve plot of trained EAGLE drafters: several drafters share the axes, and a
drafter trained without a curve is refused by name."""

from __future__ import annotations

import json

import pytest

from tooling.training.learning_curve import plot


def _drafter(directory, kind: str, curve) -> object:
    directory.mkdir()
    config = {"type": kind, "training": {"learning_curve": curve}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_two_drafters_share_one_plot(tmp_path):
    eagle = _drafter(tmp_path / "eagle", "eagle", [[50_000, [0.1, 0.08]], [100_000, [0.2, 0.15]]])
    eagle3 = _drafter(tmp_path / "eagle3", "eagle3", [[50_000, [0.12, 0.1]]])
    out = tmp_path / "curve.png"
    plot([eagle, eagle3], out, ["shipped:400000:0.4"], "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_of_a_long_chain_is_drawn(tmp_path):
    runs = [
        _drafter(tmp_path / f"run{i}", "eagle3", [[50_000, [0.5 + i / 100]]]) for i in range(6)
    ]
    out = tmp_path / "chain.png"
    assert plot(runs, out, []) == [f"run{i}" for i in range(6)]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_drafter_without_a_curve_is_named(tmp_path):
    bare = _drafter(tmp_path / "bare", "eagle", [])
    with pytest.raises(ValueError, match="bare: no learning curve"):
        plot([bare], tmp_path / "x.png", [])


def test_a_drafter_trained_on_from_another_continues_its_curve():
    from tooling.training.learning_curve import curve_points

    curve = [[50_000, [0.5]], [100_000, [0.52]]]
    started = {"drafter": "shipped", "training_answer_tokens": 5_000_000}
    tokens, points = curve_points({"learning_curve": curve, "started_from": started}, "x")
    assert tokens == [5_050_000, 5_100_000] and points == curve
    assert curve_points({"learning_curve": curve}, "x")[0] == [50_000, 100_000]
