"""Messages between the engine-core process and its async client, and the client's errors.

Everything here is a small picklable dataclass. Commands go from the server to the engine
process, reports come back. Outputs travel as deltas (the tokens new in one step), never as
cumulative lists: a long generation would otherwise be pickled again at every step.

``DeltaTracker``, ``engine_stats`` and ``engine_info`` are the engine process's side of the
protocol: they turn the engine's cumulative outputs and state into these messages. This module
imports no torch at runtime, so the server can use the types cheaply.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SampledToken, SamplingParams
    from engine.speculative_options import SpeculativeOptions


# ---- errors the client raises --------------------------------------------------------------
class EngineDeadError(RuntimeError):
    """The engine process died while a request was in flight."""


class EngineNotReadyError(RuntimeError):
    """The engine is starting, restarting, has given up restarting, or was shut down."""


class EngineStartError(RuntimeError):
    """The engine process exited (or reported a failure) before it was ready."""


class StreamBacklogError(RuntimeError):
    """The request's consumer fell too far behind its output; the request was aborted."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's per-request time limit; it was aborted."""


# ---- what the engine reports ---------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    """Facts about the loaded model that the server needs to validate requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    decoders: list[str] = field(default_factory=lambda: ["autoregressive"])  # a request may pick


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken after every step; counts are of requests, not sequences.

    The counters (``COUNTERS``) are cumulative over one engine process's life; the other
    fields are gauges of its state now.
    """

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "spec_num_drafts",
        "spec_num_draft_tokens",
        "spec_num_accepted_tokens",
        "spec_accepted_per_position",
        "spec_num_trimmed_drafts",
        "spec_by_decoder",
        "spec_draft_lengths",
    )

    num_running: int = 0  # requests with at least one sequence in the running queue
    num_waiting: int = 0  # unfinished requests with none running (queued or preempted)
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by live sequences, 0..1
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found
    num_free_blocks: int = 0
    num_blocks: int = 0
    decoder: str = "autoregressive"
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters).
    spec_num_drafts: int = 0  # draft runs verified (one per sequence and step with drafts)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # accepted drafts at position 0, 1, ...
    # Drafts made but not verified: their chance was under the draft policy's floor.
    spec_num_trimmed_drafts: int = 0
    # The same four counters per drafting decoder: (name, (drafts, draft tokens, accepted,
    # accepted per position)), one entry per loaded decoder.
    spec_by_decoder: tuple[tuple[str, tuple], ...] = ()
    # The goodput policy (when on): per decoder, how many steps it chose each draft length
    # (index = length; 0 = that decoder's sequences drafted nothing), and its last choice's
    # predicted step time against the time the step took (seconds; gauges).
    spec_draft_lengths: tuple[tuple[str, tuple[int, ...]], ...] = ()
    spec_policy_predicted_seconds: float = 0.0
    spec_policy_measured_seconds: float = 0.0


@dataclass
class ChoiceDelta:
    """What one of a request's ``n`` continuations gained in one step.

    A choice appears in a delta only when it has new tokens or has just finished, so its
    ``finish_reason`` ("stop" | "length" | "abort") is non-None in exactly one delta.
    """

    index: int
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None = None  # None unless the request asked for logprobs
    new_sources: list[str] | None = None  # None unless it asked for provenance
    finish_reason: str | None = None


@dataclass
class RequestDelta:
    """One step's progress of one request; the last one has ``finished=True``."""

    request_id: str
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    finished: bool
    # Wall-clock time.time() of the start of the step that first scheduled the request
    # (None if it was aborted before it was ever scheduled).
    first_scheduled_time: float | None = None
    # RequestOutput.prompt_logprobs, in the first delta after the prompt has run (once).
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class RequestError:
    """The engine refused a request (``Engine.add_request`` raised ValueError)."""

    request_id: str
    message: str


# ---- messages on the pipe ------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    speculative: SpeculativeOptions | None = None


@dataclass(frozen=True)
class AbortRequest:
    """End a whole request, or only its continuation ``choice_index`` (the others go on).

    Either way the aborted choices are then reported once, with finish_reason "abort" and no
    new tokens; a choice that had already finished is left as it was (its reason was sent).
    """

    request_id: str
    choice_index: int | None = None


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo


@dataclass(frozen=True)
class EngineStartFailed:
    message: str


@dataclass
class EngineOutputs:
    """Everything one loop iteration produced: one pickle per step, not one per request."""

    deltas: list[RequestDelta] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)


Command = AddRequest | AbortRequest | Shutdown


# ---- building the reports in the engine process --------------------------------------------
class DeltaTracker:
    """Turns each request's cumulative ``RequestOutput`` into a ``RequestDelta``.

    It remembers, per live request, when it was first scheduled and which choices have had
    their finish_reason sent; both are dropped when the request finishes.
    """

    def __init__(self) -> None:
        self._first_scheduled: dict[str, float] = {}
        self._reported_finished: dict[str, set[int]] = {}
        self._sent_prompt_logprobs: set[str] = set()

    def mark_scheduled(self, request_ids: Iterable[str], when: float) -> None:
        """Record ``when`` as the first-scheduled time of the requests not seen before."""
        for request_id in request_ids:
            self._first_scheduled.setdefault(request_id, when)

    def delta(self, output: RequestOutput, scheduled_at: float | None = None) -> RequestDelta:
        """The new part of ``output``; ``scheduled_at``: the start of the step that produced
        it (None for the final output of an abort, which ran no step)."""
        rid = output.request_id
        if scheduled_at is not None:
            self._first_scheduled.setdefault(rid, scheduled_at)
        reported = self._reported_finished.setdefault(rid, set())
        choices = [_choice_delta(c, reported) for c in output.outputs]
        delta = RequestDelta(
            request_id=rid,
            choices=[c for c in choices if c is not None],
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_prompt_tokens=output.num_cached_prompt_tokens,
            finished=output.finished,
            first_scheduled_time=self._first_scheduled.get(rid),
        )
        if output.prompt_logprobs is not None and rid not in self._sent_prompt_logprobs:
            delta.prompt_logprobs = output.prompt_logprobs
            self._sent_prompt_logprobs.add(rid)
        if output.finished:
            self._first_scheduled.pop(rid, None)
            self._reported_finished.pop(rid, None)
            self._sent_prompt_logprobs.discard(rid)
        return delta


def _choice_delta(completion: CompletionOutput, reported: set[int]) -> ChoiceDelta | None:
    """The part of a cumulative CompletionOutput that is new; None if nothing is."""
    newly_finished = completion.finished and completion.index not in reported
    if completion.num_new_tokens == 0 and not newly_finished:
        return None
    if newly_finished:
        reported.add(completion.index)
    return ChoiceDelta(
        index=completion.index,
        new_token_ids=completion.new_token_ids,
        new_logprobs=completion.new_logprobs,
        new_sources=completion.new_sources,
        finish_reason=completion.finish_reason if newly_finished else None,
    )


def engine_stats(engine: Engine) -> EngineStats:
    """A snapshot of the engine's queues, KV cache and cumulative counters."""
    blocks, scheduler = engine.block_manager, engine.scheduler
    running = len({seq.request_id for seq in scheduler.running})
    return EngineStats(
        num_running=running,
        num_waiting=len(engine.requests) - running,
        kv_cache_usage=blocks.usage,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=blocks.stats.queries,
        prefix_cache_hits=blocks.stats.hits,
        num_free_blocks=blocks.num_free_blocks,
        num_blocks=blocks.num_blocks,
        **_spec_stats(engine),
    )


def _spec_stats(engine: Engine) -> dict:
    """The speculator's statistics (it owns them), as EngineStats fields."""
    return {} if engine.speculator is None else engine.speculator.statistics()


def engine_info(engine: Engine, model_dir: object) -> EngineInfo:
    return EngineInfo(
        model_dir=str(model_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model.arch.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        decoders=engine.loaded_decoders,
    )
