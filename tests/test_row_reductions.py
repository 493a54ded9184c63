"""The C++ reductions over logits rows equal PyTorch's: a greedy step's argmax, a draft
step's softmax with its top probability and entropy."""

from __future__ import annotations

import pytest
import torch

from engine.decoders.drafting import draft_statistics, softmax_with_statistics
from engine.kernels.build import load_kernels
from engine.sampling import greedy_tokens

pytestmark = pytest.mark.skipif(not load_kernels(), reason="no C++ kernels on this machine")


def _rows(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(5, width, generator=g) * torch.tensor([[0.1], [1.0], [4.0], [30.0], [1.0]])
    rows[4, ::3] = float("-inf")  # columns outside a drafter's vocabulary, masked tokens
    rows[4, min(1, width - 1)] = 50.0  # nearly one-hot: an entropy rounding towards 0
    return rows


# Widths below, at and past one vector, odd ones (remainder loops), a draft vocabulary, a
# whole vocabulary.
@pytest.mark.parametrize("width", [1, 2, 7, 16, 17, 100, 4096, 49152])
def test_one_pass_equals_the_pytorch_ops(width):
    scores = _rows(width)
    dists, top, entropy = torch.ops.specserve.softmax_statistics(scores)
    want = torch.softmax(scores, dim=-1)
    want_top, want_entropy = draft_statistics(want)
    torch.testing.assert_close(dists, want, rtol=1e-5, atol=1e-7)
    assert top.tolist() == pytest.approx(want_top, rel=1e-5)
    assert entropy.tolist() == pytest.approx(want_entropy, rel=1e-4, abs=1e-5)
    assert min(entropy.tolist()) >= 0.0
    assert not dists[scores == float("-inf")].any()  # exactly zero probability there


def test_drafting_gets_the_same_from_the_kernel_and_from_pytorch(monkeypatch):
    import engine.decoders.drafting as drafting

    scores = _rows(4096)
    dists, top, entropy = softmax_with_statistics(scores)
    monkeypatch.setattr(drafting, "load_kernels", lambda: False)
    want_dists, want_top, want_entropy = softmax_with_statistics(scores)
    torch.testing.assert_close(dists, want_dists, rtol=1e-5, atol=1e-7)
    assert top == pytest.approx(want_top, rel=1e-5)
    assert entropy == pytest.approx(want_entropy, rel=1e-4, abs=1e-5)
    assert isinstance(top, list) and isinstance(entropy, list)


@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 1000, 49152])
def test_argmax_takes_the_first_of_equal_maxima_as_pytorch(width):
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(6, width, generator=g)
    rows[1] = rows[1].round()  # many ties
    rows[1, -1] = rows[1, 0] = rows[1].max() + 1  # tie between the first and the last column
    rows[2] = float("-inf")  # a fully masked row: index 0
    rows[3, width // 2] = float("inf")
    rows[4, width // 3] = float("nan")  # NaN wins in PyTorch's max: the kernel defers to it
    rows[5] = rows[5].half().float()  # exactly equal values from a coarse grid
    want = rows.argmax(dim=-1)
    assert torch.equal(torch.ops.specserve.row_argmax(rows), want)
    assert torch.equal(greedy_tokens(rows), want)
    assert torch.equal(
        greedy_tokens(rows[:, : max(1, width // 2)]), rows[:, : max(1, width // 2)].argmax(-1)
    )
    assert torch.equal(greedy_tokens(rows.t().contiguous().t()), want)  # strided rows
