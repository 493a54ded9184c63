"""Sampling parameters, batched logits processing and the token sampler.

`process_logits` turns raw model logits into the distribution a request asked for (an output
constraint's mask first, then vLLM's order: min_tokens, logit bias, penalties, temperature,
top-k, top-p, min-p). `Sampler` picks one token per
row from it, drawing from each row's own generator so that seeded requests are reproducible
whatever else shares the batch. A rejection sampler reuses `process_logits` and `probabilities`.
"""

import secrets
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

from engine.kernels.build import load_kernels
from engine.logits_processing import (
    NEG_INF,
    apply_count_penalties_,
    apply_min_p_,
    apply_repetition_penalty_,
    apply_temperature_,
    apply_top_k_,
    apply_top_p_,
    probabilities,
    sample_from_probabilities,
)
from engine.sampling_params import (
    SampledToken,
    SamplingParams,
    logit_bias_problems,
)

__all__ = [
    "SampledToken",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "draw_uniforms",
    "greedy_tokens",
    "logit_bias_problems",
    "make_generator",
    "needs_processing",
    "probabilities",
    "process_logits",
    "sample_from_probabilities",
]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first index of the maximum, as ``argmax``). On the CPU in
    float32 one vectorized C++ pass per row (engine/kernels/row_reductions.cpp): ``max``
    took 70 us for one 49k-column row in a decode step. Elsewhere ``max`` over the last
    dimension, which gives the same index and on CPU runs 2-3x faster than ``argmax``."""
    if (
        logits.dim() == 2
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.shape[1] > 0
        and load_kernels()
    ):
        return torch.ops.specserve.row_argmax(logits)
    return logits.max(dim=-1).indices


class SamplingRow(Protocol):
    """One row of logits to sample: a request's parameters and the tokens it has so far.

    A speculative decoder passes one row per draft position of the same request, each with a
    different hypothetical `output_token_ids`, so nothing may be cached per request object.
    """

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...


def _masks_min_tokens(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.sampling_params.min_tokens


def _filters(params: SamplingParams) -> bool:
    # Temperature and the truncations cannot change the argmax, so greedy rows skip them.
    return not params.greedy and (
        params.temperature != 1 or params.top_k > 0 or params.top_p < 1 or params.min_p > 0
    )


def needs_processing(row: SamplingRow) -> bool:
    """Whether ``process_logits`` would change the row's logits."""
    params = row.sampling_params
    return (
        params.constraint_state is not None
        or _masks_min_tokens(row)
        or bool(params.logit_bias)
        or params.repetition_penalty != 1
        or params.presence_penalty != 0
        or params.frequency_penalty != 0
        or _filters(params)
    )


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """Apply every row's sampling parameters to its `[V]` row of `logits` (`[B, V]`, float).

    Returns a new tensor and never writes to `logits`. When no row uses any feature (all-default
    parameters, or greedy rows without bias, penalties or min_tokens) it returns `logits` itself
    without copying, so callers must treat the result as read-only as well.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"got {logits.shape[0]} rows of logits for {len(rows)} sampling rows")
    if not any(needs_processing(row) for row in rows):
        return logits
    # Contiguous, because the penalty kernels index the flattened logits.
    out = logits.clone(memory_format=torch.contiguous_format)
    # The constraint first: the distribution every later step sees is the constrained one.
    _mask_by_constraints(out, rows)
    constrained = (
        out.clone() if any(_masks_min_tokens(r) for r in rows) and _has_constraints(rows) else None
    )
    _mask_stops_before_min_tokens(out, rows, eos_token_ids)
    if constrained is not None:
        # A constraint that can only end here (a complete JSON document) wins over
        # min_tokens: a row with no token left would have no distribution at all.
        dead = torch.isinf(out).all(dim=-1) & ~torch.isinf(constrained).all(dim=-1)
        out[dead] = constrained[dead]
    _add_logit_bias(out, rows)
    _apply_penalties(out, rows)
    _apply_temperature_and_filters(out, rows)
    return out


def _has_constraints(rows: Sequence[SamplingRow]) -> bool:
    return any(row.sampling_params.constraint_state is not None for row in rows)


def _mask_by_constraints(out: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        state = row.sampling_params.constraint_state
        if state is None:
            continue
        state.mask_(out[i], row.output_token_ids)


def _mask_stops_before_min_tokens(
    out: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Collection[int]
) -> None:
    vocab_size = out.shape[-1]
    row_ids, token_ids = [], []
    for i, row in enumerate(rows):
        if not _masks_min_tokens(row):
            continue
        params = row.sampling_params
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        stops = [t for t in stops if t < vocab_size]
        row_ids += [i] * len(stops)
        token_ids += stops
    if row_ids:
        device = out.device
        out[torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)] = NEG_INF


def _add_logit_bias(out: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        bias = row.sampling_params.logit_bias or {}
        row_ids += [i] * len(bias)
        token_ids += bias.keys()
        biases += bias.values()
    if row_ids:
        device = out.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        values = torch.tensor(biases, dtype=out.dtype, device=device)
        out.index_put_(index, values, accumulate=True)


def _row_values(
    rows: Sequence[SamplingRow], picked: list[int], name: str, **tensor_kwargs: Any
) -> torch.Tensor:
    """The parameter `name` of each picked row, as a 1-D tensor."""
    values = [getattr(rows[i].sampling_params, name) for i in picked]
    return torch.tensor(values, **tensor_kwargs)


def _apply_penalties(out: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    repeat = [i for i, row in enumerate(rows) if row.sampling_params.repetition_penalty != 1]
    if repeat:
        # Repetition penalty looks at prompt and output; the OpenAI penalties at output only.
        seen = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in repeat]
        penalties = [rows[i].sampling_params.repetition_penalty for i in repeat]
        apply_repetition_penalty_(out, repeat, seen, penalties)

    additive = [
        i
        for i, row in enumerate(rows)
        if row.sampling_params.presence_penalty != 0 or row.sampling_params.frequency_penalty != 0
    ]
    if additive:
        apply_count_penalties_(
            out,
            additive,
            [rows[i].output_token_ids for i in additive],
            [rows[i].sampling_params.frequency_penalty for i in additive],
            [rows[i].sampling_params.presence_penalty for i in additive],
        )


def _apply_temperature_and_filters(out: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab_size = out.shape[-1]
    sampled = [i for i, row in enumerate(rows) if _filters(row.sampling_params)]
    # (parameter, kernel, dtype of its per-row values, whether a row uses it), in vLLM's order.
    steps = [
        ("temperature", apply_temperature_, out.dtype, lambda p: p.temperature != 1),
        ("top_k", apply_top_k_, torch.long, lambda p: 0 < p.top_k < vocab_size),
        ("top_p", apply_top_p_, out.dtype, lambda p: p.top_p < 1),
        ("min_p", apply_min_p_, out.dtype, lambda p: p.min_p > 0),
    ]
    for name, kernel, dtype, used in steps:
        picked = [i for i in sampled if used(rows[i].sampling_params)]
        if not picked:
            continue
        values = _row_values(rows, picked, name, dtype=dtype, device=out.device)
        if len(picked) == len(rows):  # common: every row; no gather and scatter back
            kernel(out, values)
        else:
            subset = out[picked]
            kernel(subset, values)
            out[picked] = subset


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (any int), or with fresh OS entropy when None."""
    if seed is None:
        seed = secrets.randbits(64)
    generator = torch.Generator(device="cpu")
    # manual_seed only accepts 64-bit values; reduce so any Python int (even negative) works.
    generator.manual_seed(seed % 2**64)
    return generator


_default_generator = make_generator(None)


def default_generator() -> torch.Generator:
    """The generator of rows that have none of their own (unseeded requests)."""
    return _default_generator


def draw_uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from that row's own generator."""
    draws = [
        torch.rand(1, generator=g or _default_generator, dtype=torch.float64) for g in generators
    ]
    return torch.cat(draws) if draws else torch.empty(0, dtype=torch.float64)


class Sampler:
    """Turns one row of model logits per sequence into one token per sequence."""

    def __init__(self, eos_token_ids: Collection[int]):
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        generators: Sequence[torch.Generator | None],
    ) -> list[SampledToken]:
        """Process `logits` (`[B, V]`) for each row and pick a token per row.

        Greedy rows take the argmax; the others sample with one uniform draw from their own
        generator (None: a shared module-level one), so a seeded row's tokens do not depend on
        the rest of the batch.
        """
        if len(generators) != len(rows):
            raise ValueError(f"got {len(generators)} generators for {len(rows)} rows")
        if not rows:
            return []
        processed = process_logits(logits, rows, self.eos_token_ids)
        sampled = [i for i, row in enumerate(rows) if not row.sampling_params.greedy]
        if len(sampled) == len(rows):  # the common all-sampled batch: skip argmax and a copy
            uniforms = draw_uniforms(generators)
            token_ids = sample_from_probabilities(probabilities(processed), uniforms)
        else:
            token_ids = greedy_tokens(processed)
            if sampled:
                probs = probabilities(processed[sampled])
                uniforms = draw_uniforms([generators[i] for i in sampled])
                token_ids[sampled] = sample_from_probabilities(probs, uniforms)
        return self._with_logprobs(logits, rows, token_ids)

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> list[SampledToken]:
        results = [SampledToken(token_id) for token_id in token_ids.tolist()]
        wanted = [i for i, row in enumerate(rows) if row.sampling_params.logprobs is not None]
        if not wanted:
            return results
        # vLLM's default: logprobs of the raw model distribution, before any processing.
        logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)
        chosen = logprobs.gather(-1, token_ids[wanted].unsqueeze(-1)).squeeze(-1).tolist()
        top_count = min(max(rows[i].sampling_params.logprobs for i in wanted), logits.shape[-1])
        top_values, top_ids = logprobs.topk(top_count, dim=-1) if top_count else (None, None)
        for j, i in enumerate(wanted):
            count = rows[i].sampling_params.logprobs
            results[i].logprob = chosen[j]
            results[i].top_logprobs = (
                list(zip(top_ids[j, :count].tolist(), top_values[j, :count].tolist(), strict=True))
                if count
                else []
            )
        return results
