"""Pearson's chi-square goodness of fit, exact survival function (no scipy needed)."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected=5.0) -> float:
    """Pearson's goodness of fit of `counts` to `probs`; cells expected fewer than `min_expected`
    times are pooled into one, so that the chi-square approximation holds."""
    expected = probs.double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token with probability 0 was emitted"
    small = (expected > 0) & (expected < min_expected)
    observed = torch.cat([counts[expected >= min_expected], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[expected >= min_expected], expected[small].sum().reshape(1)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic / 2).item()  # the chi-square survival function
