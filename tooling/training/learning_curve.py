"""The learning curve a trained EAGLE drafter keeps in its config (held-out top-1 accuracy per
depth against the answer tokens trained on), as a PNG:

    python -m tooling.training.learning_curve DRAFTER_DIR [DRAFTER_DIR ...]
        [--output docs/eagle-learning-curve.png]
        [--mark "LABEL:TOKENS:ACCURACY" ...]   # other drafters on the same held-out set

Several drafters (an ``eagle`` and an ``eagle3`` trained on the same data, say, or a chain of
warm starts) share the axes: a colour per depth, a line style per drafter, each named by its
directory at the start of its curve. A drafter
trained on from another (``--init-from``) is drawn from where that one's data ended.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def curve_points(training: dict, name) -> tuple[list[int], list]:
    """(answer tokens at each point, the points) of a drafter's record ``training``: a drafter
    trained on from another (``--init-from``) counts what that one had learnt from too."""
    curve = training.get("learning_curve") or []
    if not curve:
        raise ValueError(f"{name}: no learning curve in its config")
    offset = (training.get("started_from") or {}).get("training_answer_tokens") or 0
    return [offset + point[0] for point in curve], curve


def plot(drafters: list[Path], output: Path, marks: list[str], title: str = "") -> list[str]:
    """Draw the drafters' curves (and ``marks``) into ``output``; returns the names drawn.
    Line styles repeat after four drafters: a chain of warm starts (each run from where the
    last one's data ended) needs no style of its own to be told apart."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    drawn = []
    for style, drafter in zip(itertools.cycle(("-", "--", ":", "-.")), drafters):
        config = json.loads((drafter / "config.json").read_text())
        tokens, curve = curve_points(config["training"], drafter)
        for depth in range(len(curve[0][1])):
            # The legend names the depths (colours) once; each run is named on its curve.
            ax.plot(tokens, [100 * point[1][depth] for point in curve], marker="o",
                    linestyle=style, color=f"C{depth}",
                    label=None if drawn else f"depth {depth + 1}")  # fmt: skip
        # Alternate heights: a chain's runs start close together on the log axis.
        ax.annotate(drafter.name, (tokens[0], 100 * curve[0][1][0]), textcoords="offset points",
                    xytext=(0, 8 + 12 * (len(drawn) % 2)), fontsize=7, ha="center",
                    arrowprops={"arrowstyle": "-", "lw": 0.5})  # fmt: skip
        drawn.append(drafter.name)
    for mark in marks:  # e.g. the shipped drafter scored by `specserve train evaluate`
        label, trained, accuracy = mark.rsplit(":", 2)
        ax.scatter([float(trained)], [100 * float(accuracy)], marker="x", color="black")
        ax.annotate(label, (float(trained), 100 * float(accuracy)), textcoords="offset points",
                    xytext=(-6, -4 - 11 * marks.index(mark)), fontsize=8, ha="right")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on (a token trained on twice counts twice)")
    ax.set_ylabel("held-out top-1 accuracy (%)")
    ax.set_title(f"EAGLE drafters: held-out accuracy against training data\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafters", type=Path, nargs="+")
    parser.add_argument("--output", type=Path, default=Path("docs/eagle-learning-curve.png"))
    parser.add_argument("--title", default="", help="e.g. the target's name")
    parser.add_argument("--mark", action="append", default=[],
                        help="LABEL:TOKENS:ACCURACY, a depth-1 point to compare")  # fmt: skip
    args = parser.parse_args()
    plot(args.drafters, args.output, args.mark, args.title)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
