"""A request's choice of speculative decoder: plain data, so that the request's sequence, the
server and the engine process can carry it without importing the decoders."""

from __future__ import annotations

from dataclasses import dataclass

# The most draft tokens a step may verify per sequence (vLLM's bound too): the engine's
# configured k and a request's own are both at most this.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request's choice among the decoders the engine has loaded (the server's
    ``"speculative": {"method": ..., "num_speculative_tokens": ...}``)."""

    method: str
    num_speculative_tokens: int | None = None  # None: the decoder's configured k

    def __post_init__(self):
        k = self.num_speculative_tokens
        if k is not None and not (isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
