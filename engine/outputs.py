"""What the engine hands back each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.prompt_logprobs import PromptLogprob
from engine.sampling import SampledToken


@dataclass
class CompletionOutput:
    """One of a request's ``n`` continuations, cumulative up to this step.

    It holds the sequence's own (append-only) token and logprob lists and how far they reached
    at this step, not copies: building the outputs of a step costs the same at the ten-
    thousandth token as at the first. ``new_token_ids`` reads only this step's tokens;
    ``token_ids`` copies the continuation up to this step when asked.
    """

    index: int
    all_token_ids: list[int]  # the sequence's list, which later steps extend
    num_tokens: int  # len(all_token_ids) at this step
    num_new_tokens: int  # how many of the first num_tokens arrived in this step
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    all_logprobs: list[SampledToken] | None = None  # as all_token_ids
    text: str = ""  # filled by callers that detokenize (LLM, server)
    all_sources: list[str] | None = None  # as all_token_ids (engine.provenance), if asked
    # Once finished, with return_hidden_states: [prompt + output tokens - 1, d], the target's
    # last-layer hidden state (before the final norm) at each position that was fed; with a
    # tuple of layers, [..., len(layers) * d]: their outputs side by side.
    hidden_states: torch.Tensor | None = None

    @property
    def sources(self) -> list[str] | None:
        return None if self.all_sources is None else self.all_sources[: self.num_tokens]

    @property
    def new_sources(self) -> list[str] | None:
        if self.all_sources is None:
            return None
        return self.all_sources[self.num_tokens - self.num_new_tokens : self.num_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_tokens]

    @property
    def new_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_tokens - self.num_new_tokens : self.num_tokens]

    @property
    def logprobs(self) -> list[SampledToken] | None:
        return None if self.all_logprobs is None else self.all_logprobs[: self.num_tokens]

    @property
    def new_logprobs(self) -> list[SampledToken] | None:
        if self.all_logprobs is None:
            return None
        return self.all_logprobs[self.num_tokens - self.num_new_tokens : self.num_tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs, once the prompt has run: None for the first token
    # (nothing precedes it), then one entry per prompt token.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    # Shortcuts to the first continuation, the common n=1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
