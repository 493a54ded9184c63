"""OpenAI request bodies (pydantic) and their translation into engine sampling parameters.

Unknown fields are ignored, as the OpenAI API and vLLM do. Fields that only vLLM has (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids) are accepted as extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SpeculativeRequest(BaseModel):
    """Extension: pick one of the server's loaded decoders for this request."""

    model_config = ConfigDict(extra="forbid")
    method: str
    num_speculative_tokens: int | None = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients (and some chat UIs) send explicit nulls for fields they leave unset.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    speculative: SpeculativeRequest | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine parameters; raises ValueError naming the parameter when one is invalid."""
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(n=self.n, max_tokens=max_tokens, logprobs=logprobs, **kwargs)


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; either one may be given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or token list per choice group."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)
