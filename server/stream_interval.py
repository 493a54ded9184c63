"""Fewer, larger stream chunks: ``--stream-interval N`` (vLLM's and SGLang's flag of that name).

Every chunk a stream sends costs CPU in each process it crosses: the server's JSON and SSE
framing, and behind Ray Serve the ingress and the HTTP proxy as well (0.4-0.6 ms a chunk in
each there, docs/benchmarks.md). With an interval of N, a choice's events are held until N tokens
have gathered, then sent as one. A choice's first text is sent at once (time to first token
does not change) and its last with whatever is held; an interval of 1 sends every event as it
comes, as before.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

# server.generation's ChoiceEvent (a dataclass with index, text, token_ids, logprobs, sources,
# finish_reason); not imported, as generation.py imports this module.
ChoiceEvent = Any


def merged(first: ChoiceEvent, then: ChoiceEvent) -> ChoiceEvent:
    """One event carrying both events' text and tokens, ending as ``then`` ends."""

    def joined(a: list | None, b: list | None) -> list | None:
        # Both present or both absent: a request asks for logprobs (or sources) or not.
        return None if a is None and b is None else (a or []) + (b or [])

    return replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=joined(first.logprobs, then.logprobs),
        sources=joined(first.sources, then.sources),
    )


class StreamInterval:
    """Holds each choice's events until its interval fills; ``push`` returns what to send."""

    def __init__(self, interval: int):
        if interval < 1:
            raise ValueError(f"the stream interval must be at least 1, got {interval}")
        self.interval = interval
        self._held: dict[int, ChoiceEvent] = {}
        self._started: set[int] = set()

    def push(self, event: ChoiceEvent) -> list[ChoiceEvent]:
        if self.interval == 1:  # the default: nothing is ever held
            return [event]
        index = event.index
        if index in self._held:
            event = merged(self._held.pop(index), event)
        first = index not in self._started
        if first or event.finish_reason is not None or len(event.token_ids) >= self.interval:
            # Started once text went: a first token the detokenizer holds back (half a
            # character, the start of a stop string) does not count as the first sent.
            if event.text:
                self._started.add(index)
            return [event]
        self._held[index] = event
        return []

    def flush(self) -> list[ChoiceEvent]:
        """Whatever is still held (a stream that ended without a last event)."""
        held, self._held = list(self._held.values()), {}
        return held
