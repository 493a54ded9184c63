"""Tensor-level kernels of the sampler: logits transforms, probabilities, inverse-CDF sampling.

Nothing here knows about requests or `SamplingParams`: `engine.sampling.process_logits` picks the
rows that use a feature and calls these. Kernels whose names end in `_` modify float logits in
place: the penalty kernels at listed rows of the whole batch, the others on a `[R, V]` batch with
one parameter per row. Masked tokens are set to `-inf`, so a later softmax gives them probability
exactly zero.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
# How many top tokens apply_top_p looks at before falling back to a full sort.
TOP_P_CANDIDATES = 256
# Vocabulary block size of the two-level CDF in sample_from_probabilities.
CDF_BLOCK = 1024


def _token_positions(
    logits: torch.Tensor, row_ids: Sequence[int], token_lists: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Indices `row * V + token` into `logits.view(-1)` of each row's tokens, repeats kept."""
    vocab_size, device = logits.shape[-1], logits.device
    flat_ids = [token for tokens in token_lists for token in tokens]
    ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    rows = torch.repeat_interleave(torch.tensor(row_ids, device=device), lengths)
    # An id outside the vocabulary would land in the next row; it cannot have a logit anyway.
    valid = (ids >= 0) & (ids < vocab_size)
    return (rows * vocab_size + ids)[valid]


def _per_position(
    logits: torch.Tensor, row_ids: Sequence[int], values: Sequence[float], positions: torch.Tensor
) -> torch.Tensor:
    """Each row's value, looked up for every flat position of that row."""
    per_row = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    per_row[list(row_ids)] = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return per_row[positions // logits.shape[-1]]


def apply_repetition_penalty_(
    logits: torch.Tensor,
    row_ids: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    penalties: Sequence[float],
) -> None:
    """In place on contiguous `[B, V]` logits: penalise each listed row's seen tokens (CTRL).

    Dividing a positive logit and multiplying a negative one both push the token down for a
    penalty > 1, whatever the sign of its logit. Only the seen positions are touched, so the
    cost follows the number of tokens, not the vocabulary.
    """
    positions = _token_positions(logits, row_ids, token_lists).unique()
    penalty = _per_position(logits, row_ids, penalties, positions)
    flat = logits.view(-1)
    values = flat[positions]
    flat[positions] = torch.where(values > 0, values / penalty, values * penalty)


def apply_count_penalties_(
    logits: torch.Tensor,
    row_ids: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """In place: subtract `frequency * count + presence` from each token a listed row has."""
    positions, counts = _token_positions(logits, row_ids, token_lists).unique(return_counts=True)
    penalty = _per_position(logits, row_ids, frequency, positions) * counts + _per_position(
        logits, row_ids, presence, positions
    )
    flat = logits.view(-1)
    flat[positions] = flat[positions] - penalty


def apply_temperature_(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    """In place: divide each row by its temperature."""
    logits.div_(temperature.unsqueeze(-1))


def apply_top_k_(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place: keep the `top_k[r]` largest logits of each row (ties with the k-th are kept)."""
    largest = logits.topk(int(top_k.max()), dim=-1).values
    kth_largest = largest.gather(-1, (top_k - 1).unsqueeze(-1))
    logits.masked_fill_(logits < kth_largest, NEG_INF)


def apply_top_p_(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keep the smallest set of most likely tokens whose mass reaches `top_p[r]`."""
    probs = logits.softmax(dim=-1)
    # Sorting a 50k vocabulary costs ~20x a top-256 on CPU, and the nucleus is usually small:
    # sort everything only when some row's nucleus is not inside its top candidates.
    candidates = min(TOP_P_CANDIDATES, probs.shape[-1])
    ranked_probs, ranked_ids = probs.topk(candidates, dim=-1)
    ranked_mass = ranked_probs.cumsum(dim=-1)
    if candidates < probs.shape[-1] and (ranked_mass[:, -1] < top_p).any():
        ranked_probs, ranked_ids = probs.sort(dim=-1, descending=True)
        ranked_mass = ranked_probs.cumsum(dim=-1)
    # A token is needed while the mass of the tokens ranked above it is still short of top_p;
    # the top token has zero mass above it, so it is always kept (top_p > 0).
    keep_ranked = (ranked_mass - ranked_probs) < top_p.unsqueeze(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, ranked_ids, keep_ranked)
    logits.masked_fill_(~keep, NEG_INF)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: mask tokens less likely than `min_p[r]` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    logits.masked_fill_(probs < threshold, NEG_INF)


def probabilities(processed_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in float32, that never returns NaN for masked rows.

    A row whose logits are all `-inf` (everything masked) becomes uniform rather than NaN, so that
    sampling and rejection-sampling arithmetic stay well defined downstream.
    """
    probs = processed_logits.float().softmax(dim=-1)
    all_masked = processed_logits.amax(dim=-1) == NEG_INF
    if all_masked.any():
        probs[all_masked] = 1.0 / processed_logits.shape[-1]
    return probs


def sample_from_probabilities(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token id per row of `probs` (`[R, V]`) from `uniforms` (`[R]`).

    A float32 CDF rounds every token's share to steps of ~6e-8 (near 1), which moves ~3e-4 of the
    mass of a flat 50k-token distribution; a float64 `[R, V]` copy is exact but allocating it costs
    more than the maths. So the CDF is two-level: float64 over float32 block totals picks a block,
    then a float64 CDF of that one block picks the token; the only error left is the rounding of a
    block total (~1e-7 of its mass). Rows need not sum to exactly 1; a token with zero
    probability is never returned.
    """
    rows, vocab = probs.shape
    block = min(CDF_BLOCK, vocab)
    padding = -vocab % block
    padded = F.pad(probs, (0, padding)) if padding else probs
    blocks = padded.reshape(rows, (vocab + padding) // block, block)
    block_mass = blocks.sum(dim=-1).to(torch.float64)
    block_end = block_mass.cumsum(dim=-1)
    targets = uniforms.to(probs.device, torch.float64).unsqueeze(-1) * block_end[:, -1:]
    block_ids = _inverse_cdf(block_end, targets, block_mass)
    # The exact CDF values searched above, so no target falls before its block's start.
    block_start = F.pad(block_end[:, :-1], (1, 0)).gather(-1, block_ids)
    in_block = blocks[torch.arange(rows, device=probs.device), block_ids.squeeze(-1)]
    local_cdf = in_block.to(torch.float64).cumsum(dim=-1)
    local_ids = _inverse_cdf(local_cdf, targets - block_start, in_block)
    return (block_ids * block + local_ids).squeeze(-1)


def _inverse_cdf(cdf: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= target < cdf[i]; `targets` is `[R, 1]`."""
    # right=True skips zero-weight entries: their CDF equals the one before.
    ids = torch.searchsorted(cdf, targets, right=True)
    # Rounding can put a target at or past the total: take the last entry with positive weight
    # (where the running count of positive weights peaks).
    past_end = ids == cdf.shape[-1]
    if past_end.any():
        last_positive = (weights > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        ids = torch.where(past_end, last_positive, ids)
    return ids
