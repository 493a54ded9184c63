"""What the engine hands back each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling import SampledToken


@dataclass
class CompletionOutput:
    """One of a request's ``n`` continuations, cumulative up to this step."""

    index: int
    token_ids: list[int]
    num_new_tokens: int  # how many of token_ids arrived in this step
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[SampledToken] | None = None
    text: str = ""  # filled by callers that detokenize (LLM, server)

    @property
    def new_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_new_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

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
