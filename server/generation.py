"""One OpenAI request's life in the server: prompts to the engine, tokens back to text.

``RequestRun`` submits every prompt of a request to the engine (``n`` continuations each),
detokenizes each choice incrementally with its stop strings, records metrics as tokens
arrive, and yields ``ChoiceEvent``s in arrival order. The HTTP and WebSocket handlers turn
those events into OpenAI chunk or response objects; they share this code unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.core_protocol import EngineDeadError, RequestTimeoutError, StreamBacklogError
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SampledToken, SamplingParams
from server.metrics import ServerMetrics
from server.shutdown import ShutdownDeadline
from server.stream_interval import StreamInterval


@dataclass
class ChoiceEvent:
    index: int  # OpenAI choice index: prompt_index * n + continuation
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] | None
    finish_reason: str | None = None  # "stop" | "length"
    sources: list[str] | None = None  # with return_provenance: per token its source


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class EngineAbortedError(EngineDeadError):
    """The engine ended a choice that the server did not ask to end: the engine failed this
    request, and it is answered like an engine failure (503 / an error event)."""


@dataclass
class RequestRun:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stop: list[str]
    client: object  # AsyncEngineClient
    tokenizer: object
    metrics: ServerMetrics
    on_done: Callable[[], None] = lambda: None  # called once when the run ends, however
    speculative: object = None  # SpeculativeOptions: the request's decoder, if it chose one
    timeout_s: float | None = None  # the server's per-request time limit, from arrival
    arrival: float = field(default_factory=time.time)
    stream_interval: int = 1  # tokens a choice gathers before an event is sent (first: at once)
    usage: Usage = field(default_factory=Usage)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    # Completion tokens per choice whose text has reached the consumer, for usage mid-stream.
    token_counts: dict[int, int] = field(default_factory=dict)
    # Completion tokens per choice the engine generated (some may be held back by the stream
    # interval), for the metrics of a choice that ends unfinished.
    generated: dict[int, int] = field(default_factory=dict)
    # Per prompt, when asked for: [None, PromptLogprob, ...] (engine.prompt_logprobs).
    prompt_logprobs: dict[int, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Known before any token: every chunk of continuous usage stats carries it.
        self.usage.prompt_tokens = sum(len(prompt) for prompt in self.prompts)

    def usage_so_far(self) -> Usage:
        """Usage up to the last event (vLLM's continuous_usage_stats)."""
        return Usage(
            self.usage.prompt_tokens, sum(self.token_counts.values()), self.usage.cached_tokens
        )

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """All choices' events, interleaved as they arrive; ends when every choice is done.
        A choice that ends any other way than stop or length is counted with how it ended
        (``ending_of``): the client left, the deadline passed, the reader fell behind, the
        engine failed."""
        ending = "abort"  # left before the end without an error: the client went away
        try:
            if len(self.prompts) == 1:
                async with contextlib.aclosing(self._prompt_events(0)) as events:
                    async for event in events:
                        yield self._sent(event)
            else:
                async with contextlib.aclosing(self._merged_events()) as events:
                    async for event in events:
                        yield self._sent(event)
            ending = None
        except BaseException as e:
            ending = ending_of(e)
            raise
        finally:
            if ending is not None:
                self._count_unfinished(ending)
            self.on_done()

    def endings(self) -> str:
        """The request's finish reasons for its log line ("stop", "length,stop", "abort")."""
        return ",".join(sorted(set(self.finish_reasons.values()))) or "none"

    def _count_unfinished(self, ending: str) -> None:
        """Every choice without a finish reason yet ends as ``ending``."""
        for index in range(len(self.prompts) * self.params.n):
            if index not in self.finish_reasons:
                self.finish_reasons[index] = ending
                tokens = self.generated.get(index, 0)
                self.metrics.on_finished(ending, time.time() - self.arrival, tokens)

    async def _merged_events(self) -> AsyncIterator[ChoiceEvent]:
        # Bounded: a reader that stops holds every prompt's pump at its next put, so each
        # prompt's stream backs up to the client's bound and is aborted in the engine (as a
        # single prompt's is), instead of the engine generating into this queue unread.
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.prompts))
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.prompts))]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, prompt_index: int, queue: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(self._prompt_events(prompt_index)) as events:
                async for event in events:
                    await queue.put(event)
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        await queue.put(None)

    async def _prompt_events(self, prompt_index: int) -> AsyncIterator[ChoiceEvent]:
        prompt, n = self.prompts[prompt_index], self.params.n
        # Their text is held back until the engine says whether they ended the choice.
        stop_ids = set(self.params.stop_token_ids) | set(self.client.info.eos_token_ids)
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt,
                self.stop,
                stop_token_ids=stop_ids,
                min_tokens=self.params.min_tokens,
            )
            for _ in range(n)
        ]
        engine_id = f"{self.request_id}-{prompt_index}"
        interval = StreamInterval(self.stream_interval)
        stream = self.client.generate(engine_id, prompt, self.params, self.speculative)
        events = self._choice_events(stream, prompt_index, detoks, interval)
        # aclosing: leaving the loop early (all choices stopped, a disconnect) aborts at once.
        async with contextlib.aclosing(stream), contextlib.aclosing(events):
            try:
                async for event in events:
                    yield event
            except Exception:
                # A stream that fails (deadline, engine failure, backlog) still sends the text
                # the interval holds, as an interval of one would have, before its error.
                for sent in interval.flush():
                    yield sent
                raise
        for sent in interval.flush():
            yield sent

    async def _choice_events(self, stream, prompt_index: int, detoks, interval):
        """The engine stream's deltas as choice events, through the stream interval."""
        n = self.params.n
        open_choices = set(range(n))
        engine_id = f"{self.request_id}-{prompt_index}"
        clock = _TokenClock(self.metrics, self.arrival, len(self.prompts[prompt_index]))
        while True:
            try:
                delta = await self._next_delta(stream)
            except StopAsyncIteration:
                break
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
            if clock.on_delta(delta):
                self.usage.cached_tokens += delta.num_cached_prompt_tokens
            for c in delta.choices:
                if c.index not in open_choices:
                    continue  # ended here by a stop string; the engine may lag behind
                event = self._choice_event(prompt_index * n + c.index, detoks[c.index], c)
                if event.finish_reason is not None:
                    open_choices.discard(c.index)
                    self._finish(event.index, event.finish_reason, detoks[c.index])
                    if c.finish_reason is None and open_choices:
                        # A stop string ended this one choice: free its sequence now.
                        await self.client.abort(engine_id, choice_index=c.index)
                for sent in interval.push(event):
                    yield sent
            if not open_choices:
                break

    def _sent(self, event: ChoiceEvent) -> ChoiceEvent:
        # Usage mid-stream counts the tokens whose text reached the consumer, not those held.
        self.token_counts[event.index] = self.token_counts.get(event.index, 0) + len(
            event.token_ids
        )
        return event

    async def _next_delta(self, stream):
        """The stream's next delta, within the request's wall-clock deadline (from arrival):
        a request that waits in the queue, or on an engine that stopped stepping, ends at its
        deadline as one that is generating does. Ending it closes the engine stream, which
        aborts the request in the engine."""
        if self.timeout_s is None:
            return await stream.__anext__()
        remaining = self.arrival + self.timeout_s - time.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(stream.__anext__(), remaining)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request ran past the server's limit of {self.timeout_s:g} s"
            ) from None

    def _choice_event(self, index: int, detok: IncrementalDetokenizer, c) -> ChoiceEvent:
        if c.finish_reason == "abort":
            raise EngineAbortedError(f"the engine aborted choice {index}")
        counted = detok.token_count
        piece = detok.push(c.new_token_ids)
        text, finish = piece.text, None
        if piece.stopped:
            finish = "stop"
        elif c.finish_reason is not None:
            text += detok.finish(drop_last_token=c.finish_reason == "stop")
            finish = c.finish_reason  # "stop" or "length"
        logprobs, sources = c.new_logprobs, c.new_sources
        self.generated[index] = detok.token_count
        covered = detok.token_count - counted  # the tokens the text covers (none past a stop)
        if logprobs is not None:
            logprobs = logprobs[:covered]
        if sources is not None:
            sources = sources[:covered]
        event = ChoiceEvent(index, text, list(c.new_token_ids[:covered]), logprobs, finish)
        event.sources = sources
        return event

    def _finish(self, index: int, reason: str, detok: IncrementalDetokenizer) -> None:
        self.finish_reasons[index] = reason
        self.usage.completion_tokens += detok.token_count
        self.metrics.on_finished(reason, time.time() - self.arrival, detok.token_count)


def ending_of(error: BaseException) -> str:
    """How a request that stopped with ``error`` ended, as ``finished_reason`` counts it."""
    if isinstance(error, StreamBacklogError):
        return "client_too_slow"
    if isinstance(error, RequestTimeoutError):
        return "timeout"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit, ShutdownDeadline)):
        return "abort"  # the client went away, or the server is going
    return "error"


class _TokenClock:
    """Latency metrics of one engine request: TTFT and queue time once, then gaps."""

    def __init__(self, metrics: ServerMetrics, arrival: float, prompt_tokens: int):
        self.metrics = metrics
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.last: float | None = None

    def on_delta(self, delta) -> bool:
        """Record a delta's tokens; True when it carried the request's first token."""
        counts = [len(c.new_token_ids) for c in delta.choices if c.new_token_ids]
        if not counts:
            return False
        now = time.time()
        first = self.last is None
        if first:
            scheduled = delta.first_scheduled_time
            queue_time = None if scheduled is None else scheduled - self.arrival
            self.metrics.on_first_token(now - self.arrival, queue_time, self.prompt_tokens)
        # One inter-token gap per choice that moved, as vLLM records per sequence and step.
        self.metrics.on_tokens(sum(counts), None if first else now - self.last, len(counts))
        self.last = now
        return first
