"""Bounds on what one request may ask for, checked before any work is done.

Without them a single request could fan out into thousands of sequences (``n``, prompt lists),
or make the server tokenize a huge body, and slow every other user. The defaults follow the
OpenAI API where it has a limit (``n`` up to 128, ``top_logprobs`` up to 20) and are generous
elsewhere; ``specserve serve --max-...`` changes each. A request beyond a limit gets an
OpenAI-shaped 400 naming the parameter and the limit; a body beyond ``max_body_bytes`` gets a
413 before it is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from server.errors import APIError, error_body


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128
    max_prompts: int = 256
    max_stop: int = 16
    max_stop_length: int = 512
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_banned_words: int = 256
    max_top_logprobs: int = 20
    max_messages: int = 1024
    max_content_parts: int = 256
    max_body_bytes: int = 8 * 1024 * 1024


DESCRIPTIONS = {
    "max_n": "choices per request (n)",
    "max_prompts": "prompts in one completion request",
    "max_stop": "stop strings per request",
    "max_stop_length": "characters in one stop string",
    "max_stop_token_ids": "entries of stop_token_ids",
    "max_logit_bias": "entries of logit_bias",
    "max_banned_words": "entries of banned_words (each at most max_stop_length characters)",
    "max_top_logprobs": "top_logprobs (chat) and logprobs (completions)",
    "max_messages": "messages in one chat request",
    "max_content_parts": "content parts in one message",
    "max_body_bytes": "bytes of a request body or WebSocket message",
}
assert set(DESCRIPTIONS) == {f.name for f in fields(RequestLimits)}


def _too_many(param: str, what: str, limit: int) -> APIError:
    return APIError(400, f"{param}: at most {limit} {what}", param=param, code="invalid_value")


def check_sampling_limits(body, limits: RequestLimits) -> None:
    """The limits shared by chat and text completions."""
    if body.n > limits.max_n:
        raise _too_many("n", "choices", limits.max_n)
    stops = body.stop_strings
    if len(stops) > limits.max_stop:
        raise _too_many("stop", "stop strings", limits.max_stop)
    if any(len(s) > limits.max_stop_length for s in stops):
        raise _too_many("stop", "characters per stop string", limits.max_stop_length)
    banned = body.banned_words or []
    if len(banned) > limits.max_banned_words:
        raise _too_many("banned_words", "entries", limits.max_banned_words)
    if any(len(w) > limits.max_stop_length for w in banned):
        raise _too_many("banned_words", "characters per entry", limits.max_stop_length)
    if body.stop_token_ids and len(body.stop_token_ids) > limits.max_stop_token_ids:
        raise _too_many("stop_token_ids", "token ids", limits.max_stop_token_ids)
    if body.logit_bias and len(body.logit_bias) > limits.max_logit_bias:
        raise _too_many("logit_bias", "entries", limits.max_logit_bias)


def check_chat_limits(body, limits: RequestLimits) -> None:
    check_sampling_limits(body, limits)
    if len(body.messages) > limits.max_messages:
        raise _too_many("messages", "messages", limits.max_messages)
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list) and len(message.content) > limits.max_content_parts:
            raise _too_many(f"messages[{i}].content", "content parts", limits.max_content_parts)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= limits.max_top_logprobs:
        raise APIError(
            400,
            f"top_logprobs must be in [0, {limits.max_top_logprobs}]",
            param="top_logprobs",
            code="invalid_value",
        )


def check_completion_limits(body, limits: RequestLimits) -> None:
    check_sampling_limits(body, limits)
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        if len(body.prompt) > limits.max_prompts:
            raise _too_many("prompt", "prompts", limits.max_prompts)
    if body.logprobs is not None and not 0 <= body.logprobs <= limits.max_top_logprobs:
        raise APIError(
            400,
            f"logprobs must be in [0, {limits.max_top_logprobs}]",
            param="logprobs",
            code="invalid_value",
        )


class BodySizeLimit:
    """ASGI middleware: an HTTP request body over ``max_bytes`` is answered with a 413 before
    the application reads (parses, tokenizes) any of it. The body is read here and handed on,
    so a chunked body without Content-Length is bounded too."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            error_body(413, f"request body larger than {self.max_bytes} bytes", code="too_large")
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
