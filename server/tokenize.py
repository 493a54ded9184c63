"""vLLM's ``/tokenize`` and ``/detokenize``: what the served model's tokenizer makes of a
prompt or a chat (rendered by the same template and options as a chat completion)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import APIError, invalid_parameter, validation_error
from server.field_policy import check_extra_fields
from server.handlers import render_chat
from server.limits import check_chat_limits
from server.protocol import ChatCompletionRequest
from server.state import ServerState
from server.valid_text import check_valid_text

_CHAT_TEMPLATE_FIELDS = {
    "model", "messages", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "chat_template_kwargs",
}  # fmt: skip


class TokenizeRequest(BaseModel):
    """A text prompt, or chat ``messages`` with the chat-template options of a completion."""

    model_config = ConfigDict(extra="allow")  # the chat form's fields, checked as a chat's
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for a chat
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    _check(state, body.model)
    check_valid_text(body.model_dump(exclude_none=True))
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either `prompt` or `messages`", param="prompt")
    tokenizer = state.tokenizer
    if body.prompt is not None:
        check_extra_fields(body.model_extra)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=special)
    else:
        ids = await asyncio.to_thread(_chat_ids, state, body)
    response = {"count": len(ids), "max_model_len": state.client.info.max_model_len, "tokens": ids}
    response["token_strs"] = (
        tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    )
    return response


def _chat_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    fields = body.model_dump(exclude={"prompt", "return_token_strs"}, exclude_none=True)
    # Only what shapes the prompt: sampling fields here would be accepted and mean nothing.
    check_extra_fields({k: v for k, v in fields.items() if k not in _CHAT_TEMPLATE_FIELDS})
    try:
        chat = ChatCompletionRequest.model_validate({**fields, "model": state.settings.model_name})
        check_extra_fields(chat.model_extra)
        check_chat_limits(chat, state.settings.limits)  # the same message limits as chat
        chat.check_template_options()
    except ValidationError as e:
        raise validation_error(e) from None
    except ValueError as e:
        raise invalid_parameter(e) from None
    return render_chat(state.tokenizer, chat)


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    _check(state, body.model)
    vocab = state.client.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"tokens must be ids in [0, {vocab}), got {bad[:10]}", param="tokens",
            code="invalid_value",
        )  # fmt: skip
    return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}


def _check(state: ServerState, model: str | None) -> None:
    if model is not None:  # optional here, as in vLLM
        state.check_model(model)
    state.check_ready()
