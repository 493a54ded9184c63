"""Verification of draft tokens: the lossless rejection sampler that every decoder shares.

A decoder proposes a chain of k draft tokens per sequence; the target scores the prefix and every
draft in one forward pass, giving k + 1 rows of logits. `RejectionSampler` turns them into the
tokens to emit, the accepted drafts and exactly one more, so that the emitted sequence is
distributed as if the target had sampled it one token at a time (Leviathan et al. 2023, Chen et
al. 2023):

- the target distribution p_j at position j is the logits processed as if drafts[:j] had already
  been emitted, so penalties and min_tokens see that hypothetical history;
- draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the
  token is drawn from norm(max(0, p_j - q_j)); when every draft is accepted a bonus token is drawn
  from p_k;
- a deterministic drafter (no q) has q_j one-hot at x_j, for which the same rule reads: accept
  with probability p_j(x_j), otherwise draw from p_j with x_j's mass removed;
- greedy rows accept while the draft is the argmax of p_j and emit the argmax where they stop.

A run may also hand in a token tree (``DraftRun.parents``); ``engine.tree_verification`` holds
the tree rules, which read exactly as these on a chain-shaped tree.

Stopping (EOS, stop ids, max_tokens) is the caller's job: every chain is verified to its end.
"""

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.sampling import (
    SampledToken,
    SamplingParams,
    SamplingRow,
    default_generator,
    draw_uniforms,
    greedy_tokens,
    probabilities,
    process_logits,
    sample_from_probabilities,
)
from engine.token_tree import path_to
from engine.tree_verification import (
    verify_tree_drawn,
    verify_tree_greedy,
    verify_tree_one_hot,
)

__all__ = ["DraftRun", "RejectionSampler", "VerifiedRun", "position_row"]

# (the accepted drafts' indices, the emitted token ids: theirs and one more) for one run.
_Outcome = tuple[list[int], list[int]]


@dataclass
class DraftRun:
    """One sequence's drafts to verify.

    `row` holds the request's parameters and its tokens before the drafts. `draft_probs` (`[k, V]`)
    is the drafter's distribution q at each draft position after the same processing as the
    target; None means a deterministic drafter, whose q is one-hot at each draft token. A None
    `generator` draws from the shared module-level one. `parents` makes the drafts a token tree
    (draft i follows draft parents[i], -1 the sequence's tokens); None is a chain.
    """

    row: SamplingRow
    draft_token_ids: Sequence[int]
    draft_probs: torch.Tensor | None = None
    generator: torch.Generator | None = None
    parents: Sequence[int] | None = None


@dataclass
class VerifiedRun:
    """The accepted drafts (`path`, indices root to leaf: a chain's first `num_accepted`), then one
    more token: `num_accepted + 1` tokens in all."""

    path: list[int]
    tokens: list[SampledToken]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class _History(Sequence[int]):
    """A sequence's output tokens followed by some drafts, without copying the output."""

    def __init__(self, output: Sequence[int], drafts: Sequence[int]):
        self._output, self._drafts = output, drafts

    def __len__(self) -> int:
        return len(self._output) + len(self._drafts)

    def __iter__(self) -> Iterator[int]:
        yield from self._output
        yield from self._drafts

    def __getitem__(self, index):
        # Off the hot path (the logits kernels only iterate and take lengths): just materialise.
        return [*self][index]


@dataclass
class _PositionRow:
    """The `SamplingRow` of draft position j: the request as if drafts[:j] had been emitted."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def position_row(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    drafts: Sequence[int],
) -> _PositionRow:
    """The sampling row of the position after ``drafts``: the request as if they had been
    emitted (drafters process their own logits with it, so q and p see the same history)."""
    return _PositionRow(params, prompt_token_ids, _History(output_token_ids, drafts))


def _position_rows(run: DraftRun) -> list[_PositionRow]:
    """Position 0, then one per draft: the request as if the drafts leading there were emitted
    (the first j of a chain, the path to the draft in a tree)."""
    row, drafts = run.row, run.draft_token_ids
    if run.parents is None:
        histories = [drafts[:j] for j in range(len(drafts) + 1)]
    else:
        paths = [path_to(run.parents, node) for node in range(-1, len(drafts))]
        histories = [[drafts[i] for i in path] for path in paths]
    return [
        position_row(row.sampling_params, row.prompt_token_ids, row.output_token_ids, history)
        for history in histories
    ]


def _num_leading_true(flags: Iterable[bool]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


class RejectionSampler:
    """Verifies drafts against the target's logits, losslessly, for any sampling parameters."""

    def __init__(self, eos_token_ids: Collection[int]):
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(self, target_logits: torch.Tensor, runs: Sequence[DraftRun]) -> list[VerifiedRun]:
        """Verify each run's drafts; `target_logits` (`[sum(k_i + 1), V]`) holds, run after run,
        the target's raw logits at positions 0..k_i (position j follows the first j drafts).

        Sampled runs draw their uniforms from their own generator in a fixed order, so a seeded
        run's outcome does not depend on the rest of the batch; with deterministic drafts it
        does not depend on k either (see ``_verify_one_hot``).
        """
        starts = _run_starts(target_logits, runs)
        if not runs:
            return []
        rows = [row for run in runs for row in _position_rows(run)]
        processed = process_logits(target_logits, rows, self.eos_token_ids)
        outcomes: list[_Outcome] = [([], [])] * len(runs)
        for i, run in enumerate(runs):
            if run.parents is not None:
                outcomes[i] = _verify_tree(processed, run, starts[i])
        chains = [i for i, run in enumerate(runs) if run.parents is None]
        greedy = [i for i in chains if runs[i].row.sampling_params.greedy]
        sampled = [i for i in chains if not runs[i].row.sampling_params.greedy]
        one_hot = [i for i in sampled if runs[i].draft_probs is None]
        general = [i for i in sampled if runs[i].draft_probs is not None]
        for picked, verify in (
            (greedy, _verify_greedy),
            (one_hot, _verify_one_hot),
            (general, _verify_sampled),
        ):
            if picked:
                results = verify(processed, [runs[i] for i in picked], [starts[i] for i in picked])
                for i, outcome in zip(picked, results, strict=True):
                    outcomes[i] = outcome
        return _with_logprobs(target_logits, runs, starts, outcomes)


def _verify_tree(processed: torch.Tensor, run: DraftRun, start: int) -> _Outcome:
    rows = processed[start : start + len(run.draft_token_ids) + 1]
    drafts, parents = run.draft_token_ids, run.parents
    if run.row.sampling_params.greedy:
        outcome = verify_tree_greedy(rows, drafts, parents)
    elif run.draft_probs is None:
        outcome = verify_tree_one_hot(rows, drafts, parents, run.generator)
    else:
        outcome = verify_tree_drawn(rows, drafts, parents, run.draft_probs, run.generator)
    return outcome.path, outcome.tokens


def _run_starts(target_logits: torch.Tensor, runs: Sequence[DraftRun]) -> list[int]:
    """The first row of each run in `target_logits`, after checking that the shapes agree."""
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [rows, vocab], got {tuple(target_logits.shape)}")
    vocab_size = target_logits.shape[1]
    starts, total = [], 0
    for run in runs:
        k = len(run.draft_token_ids)
        if not all(0 <= token < vocab_size for token in run.draft_token_ids):
            raise ValueError(
                f"draft token ids must be in [0, {vocab_size}), got {run.draft_token_ids}"
            )
        if run.parents is not None and len(run.parents) != k:
            raise ValueError(f"{len(run.parents)} tree parents for {k} draft tokens")
        if run.draft_probs is not None and tuple(run.draft_probs.shape) != (k, vocab_size):
            shape = tuple(run.draft_probs.shape)
            raise ValueError(f"draft_probs must have shape ({k}, {vocab_size}), got {shape}")
        starts.append(total)
        total += k + 1
    if target_logits.shape[0] != total:
        raise ValueError(
            f"got {target_logits.shape[0]} rows of target logits for {total} positions"
        )
    return starts


def _verify_greedy(
    processed: torch.Tensor, runs: Sequence[DraftRun], starts: Sequence[int]
) -> list[_Outcome]:
    # Argmax over every row, sampled ones included: as cheap as gathering the greedy rows first.
    best = greedy_tokens(processed).tolist()
    outcomes = []
    for run, start in zip(runs, starts, strict=True):
        drafts = list(run.draft_token_ids)
        targets = best[start : start + len(drafts) + 1]
        m = _num_leading_true(d == t for d, t in zip(drafts, targets, strict=False))
        outcomes.append((list(range(m)), [*drafts[:m], targets[m]]))
    return outcomes


def _verify_one_hot(
    processed: torch.Tensor, runs: Sequence[DraftRun], starts: Sequence[int]
) -> list[_Outcome]:
    """Deterministic drafts, verified so that the output is the token plain sampling draws.

    At each position draw the token autoregressive sampling would (inverse CDF of p_j at the
    run's next uniform); accept the draft while they agree, emit the drawn token at the first
    disagreement. P(draw = x) = p(x), and a draw that is not x follows p with x removed: the
    same law as "accept with p(x), else resample from the residual". But exactly one uniform
    is consumed per emitted token, as in ``Sampler``, so a seeded request gives the same tokens
    whatever k it was granted and whatever else is in the batch.
    """
    sizes = [len(run.draft_token_ids) + 1 for run in runs]
    rows = [start + j for start, size in zip(starts, sizes, strict=True) for j in range(size)]
    probs = probabilities(processed[rows])
    states, uniforms = [], []
    for run, size in zip(runs, sizes, strict=True):
        generator = run.generator or default_generator()
        states.append((generator, generator.get_state()))
        uniforms.append(torch.rand(size, generator=generator, dtype=torch.float64))
    drawn = sample_from_probabilities(probs, torch.cat(uniforms)).tolist()
    outcomes, offset = [], 0
    for run, size, (generator, state) in zip(runs, sizes, states, strict=True):
        drafts = list(run.draft_token_ids)
        m = _num_leading_true(
            d == t for d, t in zip(drafts, drawn[offset : offset + size], strict=False)
        )
        outcomes.append((list(range(m)), [*drafts[:m], drawn[offset + m]]))
        # Consume only the uniforms of the m + 1 emitted tokens.
        generator.set_state(state)
        torch.rand(m + 1, generator=generator, dtype=torch.float64)
        offset += size
    return outcomes


def _verify_sampled(
    processed: torch.Tensor, runs: Sequence[DraftRun], starts: Sequence[int]
) -> list[_Outcome]:
    sizes = [len(run.draft_token_ids) + 1 for run in runs]
    rows = [start + j for start, size in zip(starts, sizes, strict=True) for j in range(size)]
    probs = probabilities(processed if len(rows) == processed.shape[0] else processed[rows])
    # Run r owns rows local[r] .. local[r] + k_r of `probs`, and the same slots of `uniforms`:
    # one uniform per draft position, then one for the final token, in that fixed order.
    local = list(accumulate(sizes, initial=0))[:-1]
    generators = [run.generator for run, size in zip(runs, sizes, strict=True) for _ in range(size)]
    uniforms = draw_uniforms(generators)
    accepted = _num_accepted(probs, uniforms, runs, local)
    final_rows = [first + m for first, m in zip(local, accepted, strict=True)]
    final = _final_distributions(probs, runs, final_rows, accepted)
    last_uniforms = uniforms[[first + size - 1 for first, size in zip(local, sizes, strict=True)]]
    tokens = sample_from_probabilities(final, last_uniforms).tolist()
    return [
        (list(range(m)), [*run.draft_token_ids[:m], token])
        for run, m, token in zip(runs, accepted, tokens, strict=True)
    ]


def _num_accepted(
    probs: torch.Tensor, uniforms: torch.Tensor, runs: Sequence[DraftRun], local: Sequence[int]
) -> list[int]:
    """How many leading drafts of each run pass the test u < p(x) / q(x)."""
    draft_rows = [
        first + j
        for run, first in zip(runs, local, strict=True)
        for j in range(len(run.draft_token_ids))
    ]
    if not draft_rows:
        return [0] * len(runs)
    draft_ids = [token for run in runs for token in run.draft_token_ids]
    p = probs[draft_rows, draft_ids].to("cpu", torch.float64)
    q = torch.cat([_draft_probability_of_drafts(run) for run in runs])
    # Written as u * q < p: no division by a zero q, and a token with p = 0 is never accepted.
    accept = (uniforms[draft_rows] * q < p).tolist()
    counts, offset = [], 0
    for run in runs:
        k = len(run.draft_token_ids)
        counts.append(_num_leading_true(accept[offset : offset + k]))
        offset += k
    return counts


def _draft_probability_of_drafts(run: DraftRun) -> torch.Tensor:
    """q_j(x_j) for each draft position j of `run`, as CPU float64 (1 for a one-hot drafter)."""
    k = len(run.draft_token_ids)
    if run.draft_probs is None:
        return torch.ones(k, dtype=torch.float64)
    device = run.draft_probs.device
    positions = torch.arange(k, device=device)
    ids = torch.tensor(list(run.draft_token_ids), dtype=torch.long, device=device)
    return run.draft_probs[positions, ids].to("cpu", torch.float64)


def _final_distributions(
    probs: torch.Tensor, runs: Sequence[DraftRun], final_rows: list[int], accepted: list[int]
) -> torch.Tensor:
    """Per run, what its last token is drawn from: the residual at the first rejection, or p_k
    when every draft was accepted. Rows are unnormalised; the inverse CDF does not need it."""
    target = probs[final_rows]
    final = target.clone()
    one_hot, one_hot_ids, general, general_q = [], [], [], []
    for r, (run, m) in enumerate(zip(runs, accepted, strict=True)):
        if m == len(run.draft_token_ids):
            continue  # all accepted: the bonus token comes from p_k itself
        if run.draft_probs is None:
            one_hot.append(r)
            one_hot_ids.append(run.draft_token_ids[m])
        else:
            general.append(r)
            general_q.append(run.draft_probs[m])
    if one_hot:
        # max(0, p - q) for a one-hot q: p with the rejected token removed.
        final[one_hot, one_hot_ids] = 0
    if general:
        final[general] = (final[general] - torch.stack(general_q).to(final)).clamp_min(0)
    # The residual is all zero only where p <= q everywhere, i.e. p == q, where exact arithmetic
    # never rejects; should rounding (or an unnormalised q) get here, p is the right distribution.
    empty = final.sum(dim=-1) <= 0
    return torch.where(empty.unsqueeze(-1), target, final)


def _with_logprobs(
    target_logits: torch.Tensor,
    runs: Sequence[DraftRun],
    starts: Sequence[int],
    outcomes: Sequence[_Outcome],
) -> list[VerifiedRun]:
    results = [VerifiedRun(path, [SampledToken(t) for t in tokens]) for path, tokens in outcomes]
    wanted = [i for i, run in enumerate(runs) if run.row.sampling_params.logprobs is not None]
    if not wanted:
        return results
    # As `Sampler` (vLLM's default): the raw model distribution at each emitted token's position:
    # the root's row, then the row after each accepted draft.
    rows = [starts[i] + node + 1 for i in wanted for node in [-1, *results[i].path]]
    ids = [token.token_id for i in wanted for token in results[i].tokens]
    logprobs = torch.log_softmax(target_logits[rows].float(), dim=-1)
    ids_tensor = torch.tensor(ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids_tensor.unsqueeze(-1)).squeeze(-1).tolist()
    top_count = min(max(runs[i].row.sampling_params.logprobs for i in wanted), logprobs.shape[-1])
    top_ids, top_values = [[]] * len(rows), [[]] * len(rows)
    if top_count:
        values, indices = logprobs.topk(top_count, dim=-1)
        top_ids, top_values = indices.tolist(), values.tolist()
    flat = 0
    for i in wanted:
        count = runs[i].row.sampling_params.logprobs
        for token in results[i].tokens:
            token.logprob = chosen[flat]
            token.top_logprobs = list(
                zip(top_ids[flat][:count], top_values[flat][:count], strict=True)
            )
            flat += 1
    return results
