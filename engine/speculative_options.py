"""A request's choice of speculative decoder: plain data, so that the request's sequence, the
server and the engine process can carry it without importing the decoders."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request's choice among the decoders the engine has loaded (the server's
    ``"speculative": {"method": ..., "num_speculative_tokens": ...}``)."""

    method: str
    num_speculative_tokens: int | None = None  # None: the decoder's configured k

    def __post_init__(self):
        k = self.num_speculative_tokens
        if k is not None and not (isinstance(k, int) and 1 <= k <= 16):
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k!r}")
