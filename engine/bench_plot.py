"""The decoder benchmark's plot: speedup over autoregressive per method, one bar per prompt set.

Written with matplotlib's Agg backend (no display needed) as a PNG, for docs/.
"""

from __future__ import annotations

from pathlib import Path


def plot_speedups(
    speedups: dict[str, dict[str, float]], path: str | Path, title: str, baseline: set[str]
) -> Path:
    """Horizontal bars of ``speedups[prompt_set][method]``; methods in first-seen order,
    the ``baseline`` ones (other implementations, e.g. transformers) hatched. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(speedups)
    methods = list(dict.fromkeys(m for per_set in speedups.values() for m in per_set))
    height = 0.8 / max(1, len(sets))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(methods) * max(1, len(sets)) / 1.6 + 1.6))
    for j, set_name in enumerate(sets):
        rows = [(i, speedups[set_name][m], m) for i, m in enumerate(methods)]
        rows = [r for r in rows if r[2] in speedups[set_name]]
        y = [i + (j - (len(sets) - 1) / 2) * height for i, _, _ in rows]
        bars = ax.barh(y, [s for _, s, _ in rows], height, label=set_name, color=f"C{j}")
        for bar, (_, value, method) in zip(bars, rows, strict=True):
            if method in baseline:
                bar.set_hatch("//")
                bar.set_alpha(0.6)
            ax.annotate(
                f"{value:.2f}x",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over autoregressive (same run; >1 is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(title="prompts", fontsize=8)
    ax.set_xlim(0, max([1.2] + [v for s in speedups.values() for v in s.values()]) * 1.15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
