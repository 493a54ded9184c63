"""Chat and text completions: validate and prepare a request, then produce OpenAI objects.

``prepare_*`` does every check that can fail before a response starts (so a bad streaming
request gets a 400, never an error inside a stream). ``stream_chunks`` yields the chunk
objects of a streaming response and ``full_response`` builds a non-streaming one; the SSE
route and the WebSocket endpoint both use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jinja2 import TemplateError

from engine.constraints.spec import ConstraintSpec
from engine.decoder_registry import DECODERS
from engine.sampling_params import logit_bias_problems
from engine.speculative_options import SpeculativeOptions
from server.errors import APIError, invalid_parameter
from server.field_policy import check_extra_fields
from server.generation import ChoiceEvent, RequestRun
from server.limits import check_chat_limits, check_completion_limits
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import (
    chat_logprobs,
    completion_logprobs,
    echo_completion_logprobs,
    merge_logprobs,
    prompt_logprobs_json,
    provenance_json,
)
from server.state import ServerState
from server.structured_output import check_usable, requested_constraint
from server.valid_text import check_valid_text


@dataclass
class Prepared:
    run: RequestRun
    chat: bool
    response_id: str
    created: int
    model: str
    include_usage: bool
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's extension)
    echo: list[str] | None = None  # completions with echo: each prompt's text, per prompt
    # Completions with echo and logprobs: the echoed prompt's tokens carry logprobs too, known
    # once the prompt has run (so a stream sends each choice's echo before its first tokens).
    echo_logprobs: int | None = None
    show_prompt_logprobs: bool = False  # the request asked for vLLM's prompt_logprobs field

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.run.params.n] if self.echo else ""

    @property
    def object_name(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def num_choices(self) -> int:
        return len(self.run.prompts) * self.run.params.n


async def _constraint_of(state: ServerState, body) -> ConstraintSpec | None:
    found = requested_constraint(body)
    if found is None:
        return None
    # Off the event loop: compiling a schema takes milliseconds, and the first constrained
    # request builds the vocabulary's llguidance tokenizer (about half a second).
    vocabulary = None if state.constraints is None else lambda: state.constraints.tokenizer
    await asyncio.to_thread(check_usable, *found, vocabulary)
    return found[1]


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    state.check_model(body.model)
    check_extra_fields(body.model_extra)
    check_valid_text(body.model_dump(exclude_none=True))
    check_chat_limits(body, state.settings.limits)
    state.check_ready()
    try:
        body.check_stream_options()
        body.check_template_options()
        logprobs = body.requested_logprobs()
        # Off the event loop: a huge prompt must not stall every other stream.
        prompt_ids = await asyncio.to_thread(render_chat, state.tokenizer, body)
        prompt_ids = _truncated(prompt_ids, body.truncate_prompt_tokens)
        max_tokens = body.requested_max_tokens()
        state.check_context(len(prompt_ids), max_tokens, "messages")
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = state.client.info.max_model_len - len(prompt_ids)
        _check_logit_bias(body.logit_bias, state.client.info.vocab_size)
        constraint = await _constraint_of(state, body)
        params = body.sampling_params(max_tokens, logprobs, constraint)
        params.validate_for_vocab(state.client.info.vocab_size)
    except ValueError as e:
        raise invalid_parameter(e) from None
    p = _prepared(state, body, [prompt_ids], params, chat=True, prefix="chatcmpl")
    if body.echo_text():
        p.echo = [body.echo_text()]
    return p


async def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    state.check_model(body.model)
    check_extra_fields(body.model_extra)
    check_valid_text(body.model_dump(exclude_none=True))
    check_completion_limits(body, state.settings.limits)
    state.check_ready()
    vocab = state.client.info.vocab_size
    try:
        body.check_stream_options()
        texts = body.prompts()
        prompts = await asyncio.to_thread(
            lambda: [_encode(state, p, vocab, body.add_special_tokens) for p in texts]
        )
        prompts = [_truncated(ids, body.truncate_prompt_tokens) for ids in prompts]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        for ids in prompts:
            state.check_context(len(ids), max_tokens, "prompt")
        _check_logit_bias(body.logit_bias, vocab)
        constraint = await _constraint_of(state, body)
        params = body.sampling_params(max_tokens, body.logprobs, constraint)
        params.validate_for_vocab(vocab)
    except ValueError as e:
        raise invalid_parameter(e) from None
    echo_logprobs = body.logprobs if body.echo else None
    if echo_logprobs is not None:  # OpenAI's echo with logprobs: the prompt's, from the engine
        params.prompt_logprobs = max(echo_logprobs, params.prompt_logprobs or 0)
    p = _prepared(state, body, prompts, params, chat=False, prefix="cmpl")
    if body.echo:
        p.echo = [t if isinstance(t, str) else state.tokenizer.decode(t) for t in texts]
        p.echo_logprobs = echo_logprobs
    return p


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens."""
    return ids if keep is None else ids[-keep:]


# What transformers passes to every chat template itself (the conversation, tools, documents)
# or defines for it (raise_exception, strftime_now): a client's variable of that name would
# collide with it or replace a function the template calls.
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "raise_exception", "strftime_now"})


def render_chat(tokenizer, body: ChatCompletionRequest) -> list[int]:

    flags = body.template_flags()
    options = _template_kwargs(tokenizer, body.chat_template_kwargs or {}, exclude=flags)
    try:
        text = tokenizer.apply_chat_template(
            body.conversation(), tokenize=False, **flags, **options
        )
    except TemplateError as e:
        # The model's template refused the conversation (its role rules, a role it does not
        # know): the client's input, so a 400 that says what the template said.
        raise APIError(
            400, f"messages: the model's chat template refused them: {e}", param="messages",
            code="invalid_value",
        ) from None  # fmt: skip
    except (TypeError, ValueError) as e:
        if not options:
            raise
        # A template variable of the client's that the template cannot take (a type it does
        # not expect, a name transformers passes too): the client's input as well.
        raise APIError(
            400, f"chat_template_kwargs: the model's chat template could not use them: {e}",
            param="chat_template_kwargs", code="invalid_value",
        ) from None  # fmt: skip
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def _template_kwargs(tokenizer, kwargs: dict, exclude) -> dict:
    """chat_template_kwargs become template variables; none may stand in for one of
    apply_chat_template's own parameters (tokenize, the conversation, the template...) but
    those in ``exclude``, which the template call takes from ``template_flags``."""

    kwargs = {k: v for k, v in kwargs.items() if k not in exclude}
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | TEMPLATE_RESERVED
    clashing = sorted(set(kwargs) & own)
    if clashing:
        raise APIError(
            400,
            f"chat_template_kwargs: {', '.join(clashing)} cannot be set this way",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    return kwargs


def _check_logit_bias(logit_bias: dict | None, vocab: int) -> None:
    """Every logit_bias problem in one 400, the vocabulary's bound included."""
    problems = logit_bias_problems(logit_bias or {}, vocab)
    if problems:
        raise ValueError("; ".join(problems))


def _encode(state: ServerState, prompt: str | list[int], vocab: int, special: bool) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return state.tokenizer.encode(prompt, add_special_tokens=special)
    if not prompt or any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be a non-empty list of ids in [0, {vocab})")
    return list(prompt)


def _speculative(state: ServerState, body) -> SpeculativeOptions | None:
    """The request's decoder choice, checked against what the engine has loaded."""
    choice = body.speculative
    if choice is None:
        return None
    loaded = state.client.info.decoders
    if choice.method not in DECODERS:
        raise APIError(
            400,
            f"unknown speculative method {choice.method!r}; known: {', '.join(DECODERS)}",
            param="speculative.method",
            code="invalid_value",
        )
    if choice.method not in loaded:
        raise APIError(
            400,
            f"speculative method {choice.method!r} is not loaded; loaded: {', '.join(loaded)}",
            param="speculative.method",
            code="invalid_value",
        )
    try:
        return SpeculativeOptions(choice.method, choice.num_speculative_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param="speculative.num_speculative_tokens") from None


def _prepared(state, body, prompts, params, chat: bool, prefix: str) -> Prepared:
    speculative = _speculative(state, body)
    reservation = state.reserve(len(prompts) * params.n)
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    run = RequestRun(
        request_id=response_id,
        prompts=prompts,
        params=params,
        stop=body.stop_strings,
        client=state.client,
        tokenizer=state.tokenizer,
        metrics=state.metrics,
        on_done=reservation.release,
        speculative=speculative,
        timeout_s=state.settings.request_timeout_s,
        stream_interval=state.settings.stream_interval,
    )
    # A response that never starts (the client left first) must still give its room back.
    weakref.finalize(run, reservation.release)
    return Prepared(
        run,
        chat,
        response_id,
        int(time.time()),
        body.model,
        body.include_usage,
        body.continuous_usage,
        show_prompt_logprobs=body.prompt_logprobs is not None,
    )


# ---- streaming -----------------------------------------------------------------------------
async def stream_chunks(p: Prepared) -> AsyncIterator[dict]:
    """The chunk objects of a streaming response, in OpenAI's order."""
    offsets = [0] * p.num_choices  # text emitted per choice, for completion text_offset
    echo_later = set()  # choices whose echo waits for the prompt's logprobs
    for i in range(p.num_choices):
        if p.chat:  # the first delta of every choice carries the role (and any echo)
            delta = {"role": "assistant", "content": p.echo_text(i)}
            first = {"index": i, "delta": delta, "logprobs": None}
            yield _chunk(p, [{**first, "finish_reason": None}])
        elif p.echo and p.echo_logprobs is not None:
            echo_later.add(i)
        elif p.echo:
            yield _chunk(p, [_echo_choice(p, i, offsets)])
    async with contextlib.aclosing(p.run.events()) as events:
        async for e in events:
            if e.index in echo_later:
                echo_later.discard(e.index)
                yield _chunk(p, [_echo_choice(p, e.index, offsets)])
            if e.text or e.finish_reason or e.logprobs or e.sources:
                yield _chunk(p, [_stream_choice(p, e, offsets)])
    if p.include_usage:
        yield {**_chunk(p, []), "usage": p.run.usage.as_dict()}


def _echo_choice(p: Prepared, index: int, offsets: list[int]) -> dict:
    offsets[index] = len(p.echo_text(index))
    choice = {"index": index, "text": p.echo_text(index), "logprobs": _echo_logprobs(p, index)}
    return {**choice, "finish_reason": None}


def _echo_logprobs(p: Prepared, index: int) -> dict | None:
    if p.echo_logprobs is None:
        return None
    prompt = p.run.prompts[index // p.run.params.n]
    entries = p.run.prompt_logprobs.get(index // p.run.params.n) or [None] * len(prompt)
    return echo_completion_logprobs(p.run.tokenizer, prompt, entries, p.echo_logprobs)


def _stream_choice(p: Prepared, e: ChoiceEvent, offsets: list[int]) -> dict:
    tokenizer = p.run.tokenizer
    if p.chat:
        delta = {"content": e.text} if e.text else {}
        choice = {
            "index": e.index,
            "delta": delta,
            "logprobs": chat_logprobs(tokenizer, e.logprobs),
        }
    else:
        logprobs = completion_logprobs(tokenizer, e.logprobs, offsets[e.index])
        choice = {"index": e.index, "text": e.text, "logprobs": logprobs}
        offsets[e.index] += len(e.text)
    if e.sources is not None:
        choice["provenance"] = provenance_json(tokenizer, e.token_ids, e.sources)
    return {**choice, "finish_reason": e.finish_reason}


def _chunk(p: Prepared, choices: list[dict]) -> dict:
    chunk = {
        "id": p.response_id,
        "object": p.object_name,
        "created": p.created,
        "model": p.model,
        "choices": choices,
    }
    if p.include_usage:
        chunk["usage"] = p.run.usage_so_far().as_dict() if p.continuous_usage else None
    return chunk


# ---- non-streaming -------------------------------------------------------------------------
async def full_response(p: Prepared) -> dict:
    events: dict[int, list[ChoiceEvent]] = {i: [] for i in range(p.num_choices)}
    async with contextlib.aclosing(p.run.events()) as stream:
        async for e in stream:
            events[e.index].append(e)
    choices = [_full_choice(p, i, evs) for i, evs in events.items()]
    response = {
        "id": p.response_id,
        "object": "chat.completion" if p.chat else "text_completion",
        "created": p.created,
        "model": p.model,
        "choices": choices,
        "usage": p.run.usage.as_dict(),
    }
    # vLLM always sends the field (null when not asked for): clients written for it read it.
    tokenizer = p.run.tokenizer
    if p.chat:  # one prompt: on the response, as vLLM puts it
        response["prompt_logprobs"] = (
            prompt_logprobs_json(tokenizer, p.run.prompt_logprobs.get(0))
            if p.show_prompt_logprobs else None
        )  # fmt: skip
    else:  # on each choice, for that choice's prompt
        for choice in choices:
            entries = p.run.prompt_logprobs.get(choice["index"] // p.run.params.n)
            choice["prompt_logprobs"] = (
                prompt_logprobs_json(tokenizer, entries) if p.show_prompt_logprobs else None
            )
    return response


def _full_choice(p: Prepared, index: int, events: list[ChoiceEvent]) -> dict:
    text = p.echo_text(index) + "".join(e.text for e in events)
    finish = p.run.finish_reasons.get(index)
    tokenizer = p.run.tokenizer
    provenance = None
    if p.run.params.return_provenance:
        token_ids = [t for e in events for t in e.token_ids]
        sources = [s for e in events for s in (e.sources or [])]
        provenance = {"provenance": provenance_json(tokenizer, token_ids, sources)}
    if p.chat:
        logprobs = merge_logprobs([chat_logprobs(tokenizer, e.logprobs) for e in events], chat=True)
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
            **(provenance or {}),
        }
    parts, offset = [_echo_logprobs(p, index)], len(p.echo_text(index))
    for e in events:
        parts.append(completion_logprobs(tokenizer, e.logprobs, offset))
        offset += len(e.text)
    return {
        "index": index,
        "text": text,
        "logprobs": merge_logprobs(parts, chat=False),
        "finish_reason": finish,
        **(provenance or {}),
    }
