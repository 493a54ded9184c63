"""OpenAI request bodies (pydantic) and their translation into engine sampling parameters.

The models declare the fields specserve honours, vLLM's extensions among them (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, the chat-template options...).
Anything else lands in ``model_extra`` and is refused by ``server.field_policy`` unless it is
given its neutral value: no field is accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import SamplingParams

# Seeds are 64-bit signed integers, as in vLLM (torch.long).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _drop_nulls(data: Any) -> Any:
    # Clients (and some chat UIs) send explicit nulls for fields they leave unset.
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


class NestedObject(BaseModel):
    """An object inside a request: unknown keys refused, explicit nulls taken as absent (as
    for the request's own fields)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return _drop_nulls(data)


class StreamOptions(NestedObject):
    # None: not given. OpenAI then sends no usage; vLLM defaults it to true, which is what
    # makes a bare {"continuous_usage_stats": true} work there, so it does here too.
    include_usage: bool | None = None
    # vLLM: usage (so far) in every chunk, not only in the last one. With include_usage false
    # the stream carries no usage at all, as vLLM's own tests pin it.
    continuous_usage_stats: bool = False
    # OpenAI's padding of deltas against length side channels; we send none, so only false.
    include_obfuscation: Literal[False] = False

    @property
    def usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        if self.include_usage is None:
            return self.continuous_usage_stats
        return self.include_usage


class SpeculativeRequest(NestedObject):
    """Extension: pick one of the server's loaded decoders for this request."""

    method: str
    num_speculative_tokens: int | None = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    # Undeclared fields are kept in model_extra for server.field_policy to refuse.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return _drop_nulls(data)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # End-user identifiers and cache hints: recorded nowhere, they change nothing, as they
    # change nothing about the output in OpenAI's API either.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    # Attached to stored completions; specserve stores none (store is refused).
    metadata: dict[str, str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = Field(None, ge=1)  # honoured only as n (refused otherwise)
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    speculative: SpeculativeRequest | None = None
    # vLLM: keep only the prompt's last k tokens.
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # vLLM: each prompt token's logprob, rank and k alternatives (not when streaming).
    prompt_logprobs: int | None = None
    # Structured output (server.structured_output turns these into the engine's constraint).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_whitespace_pattern: str | None = None  # JSON's whitespace between tokens
    # Extension: words and phrases the output never contains (whole words, any casing).
    banned_words: list[str] | None = None
    # Extension: each choice also lists its tokens with where each came from (a plain step, an
    # accepted draft, a resampled rejection, a bonus token; engine/provenance.py).
    return_provenance: bool = False

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            # As OpenAI and vLLM: the options only mean something for a stream.
            raise ValueError("stream_options can only be given when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when streaming (as in vLLM)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}): best-of ranking is not implemented")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, constraint=None
    ) -> SamplingParams:
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
            "prompt_logprobs": self.prompt_logprobs,
            "banned_words": self.banned_words,
            "return_provenance": self.return_provenance,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, constraint=constraint, **kwargs
        )


class TextContentPart(NestedObject):
    type: Literal["text"]
    text: str


# Message fields that only a tool- or audio-capable model would act on: refused unless empty.
_REFUSED_MESSAGE_FIELDS = {
    "tool_calls": "tool calling is not implemented",
    "function_call": "tool calling is not implemented",
    "audio": "audio is not implemented",
    "refusal": "assistant refusals are not passed to the model",
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None  # handed to the chat template, which may use it
    tool_call_id: str | None = None  # handed to the chat template
    # What clients echo back from a response message; only the empty value is accepted.
    annotations: list[Any] | None = Field(None, max_length=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        data = _drop_nulls(data)
        if not isinstance(data, dict):
            return data
        for name, reason in _REFUSED_MESSAGE_FIELDS.items():
            if data.get(name) not in (None, [], ""):
                raise ValueError(f"`{name}` is not supported: {reason}")
        content = data.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return {k: v for k, v in data.items() if k not in _REFUSED_MESSAGE_FIELDS}

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Only means something together with tools, which are refused: either value asks nothing.
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template options
    echo: bool = False  # prepend the last message's content when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # go on writing the last (assistant) message
    add_special_tokens: bool = False  # the template writes the special tokens itself
    chat_template_kwargs: dict[str, Any] | None = None

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
        return [m.for_template() for m in self.messages]

    def template_flags(self) -> dict[str, bool]:
        """add_generation_prompt and continue_final_message for the template call. As in
        vLLM, the same names in chat_template_kwargs win over the fields."""
        flags = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        for name in flags:
            value = (self.chat_template_kwargs or {}).get(name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"chat_template_kwargs must give {name} as true or false")
            flags[name] = flags[name] if value is None else value
        return flags

    def check_template_options(self) -> None:
        flags = self.template_flags()
        if flags["continue_final_message"] and flags["add_generation_prompt"]:
            raise ValueError(
                "continue_final_message needs add_generation_prompt false (the last message "
                "is continued, not answered)"
            )
        if flags["continue_final_message"] and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content when it is the response's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_form(cls, value: Any) -> Any:
        # pydantic would report the first union member's complaint ("prompt.str: ..."); say
        # which forms exist instead.
        forms = (
            isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
            or (isinstance(value, list) and all(_is_token(v) for v in value))
            or (
                isinstance(value, list)
                and all(isinstance(v, list) and all(map(_is_token, v)) for v in value)
            )
        )
        if not forms:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists"
            )
        return value

    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt

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
