"""Chat and text completions: validate and prepare a request, then produce OpenAI objects.

``prepare_*`` does every check that can fail before a response starts (so a bad streaming
request gets a 400, never an error inside a stream). ``stream_chunks`` yields the chunk
objects of a streaming response and ``full_response`` builds a non-streaming one; the SSE
route and the WebSocket endpoint both use them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from server.errors import APIError, invalid_parameter
from server.generation import ChoiceEvent, RequestRun
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import chat_logprobs, completion_logprobs, merge_logprobs
from server.state import ServerState


@dataclass
class Prepared:
    run: RequestRun
    chat: bool
    response_id: str
    created: int
    model: str
    include_usage: bool

    @property
    def object_name(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def num_choices(self) -> int:
        return len(self.run.prompts) * self.run.params.n


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    state.check_model(body.model)
    state.check_ready()
    try:
        logprobs = body.requested_logprobs()
        prompt = state.tokenizer.apply_chat_template(
            body.conversation(), tokenize=False, add_generation_prompt=True
        )
        prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = body.requested_max_tokens()
        state.check_context(len(prompt_ids), max_tokens)
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = state.client.info.max_model_len - len(prompt_ids)
        params = body.sampling_params(max_tokens, logprobs)
        params.validate_for_vocab(state.client.info.vocab_size)
    except ValueError as e:
        raise invalid_parameter(e) from None
    return _prepared(state, body, [prompt_ids], params, chat=True, prefix="chatcmpl")


def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    state.check_model(body.model)
    state.check_ready()
    vocab = state.client.info.vocab_size
    try:
        prompts = [_encode(state, p, vocab) for p in body.prompts()]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        for ids in prompts:
            state.check_context(len(ids), max_tokens)
        params = body.sampling_params(max_tokens, body.logprobs)
        params.validate_for_vocab(vocab)
    except ValueError as e:
        raise invalid_parameter(e) from None
    return _prepared(state, body, prompts, params, chat=False, prefix="cmpl")


def _encode(state: ServerState, prompt: str | list[int], vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return state.tokenizer.encode(prompt)
    if not prompt or any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be a non-empty list of ids in [0, {vocab})")
    return list(prompt)


def _prepared(state, body, prompts, params, chat: bool, prefix: str) -> Prepared:
    state.check_capacity()
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    run = RequestRun(
        request_id=response_id,
        prompts=prompts,
        params=params,
        stop=body.stop_strings,
        client=state.client,
        tokenizer=state.tokenizer,
        metrics=state.metrics,
    )
    return Prepared(run, chat, response_id, int(time.time()), body.model, body.include_usage)


# ---- streaming -----------------------------------------------------------------------------
async def stream_chunks(p: Prepared) -> AsyncIterator[dict]:
    """The chunk objects of a streaming response, in OpenAI's order."""
    tokenizer = p.run.tokenizer
    offsets = [0] * p.num_choices  # text emitted per choice, for completion text_offset
    if p.chat:  # the first delta of every choice carries the role
        for i in range(p.num_choices):
            yield _chunk(
                p,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
    async for e in p.run.events():
        if not (e.text or e.finish_reason or e.logprobs):
            continue
        if p.chat:
            delta = {"content": e.text} if e.text else {}
            choice = {
                "index": e.index,
                "delta": delta,
                "logprobs": chat_logprobs(tokenizer, e.logprobs),
            }
        else:
            choice = {
                "index": e.index,
                "text": e.text,
                "logprobs": completion_logprobs(tokenizer, e.logprobs, offsets[e.index]),
            }
            offsets[e.index] += len(e.text)
        choice["finish_reason"] = e.finish_reason
        yield _chunk(p, [choice])
    if p.include_usage:
        yield {**_chunk(p, []), "usage": p.run.usage.as_dict()}


def _chunk(p: Prepared, choices: list[dict]) -> dict:
    chunk = {
        "id": p.response_id,
        "object": p.object_name,
        "created": p.created,
        "model": p.model,
        "choices": choices,
    }
    if p.include_usage:
        chunk["usage"] = None
    return chunk


# ---- non-streaming -------------------------------------------------------------------------
async def full_response(p: Prepared) -> dict:
    events: dict[int, list[ChoiceEvent]] = {i: [] for i in range(p.num_choices)}
    async for e in p.run.events():
        events[e.index].append(e)
    choices = [_full_choice(p, i, evs) for i, evs in events.items()]
    return {
        "id": p.response_id,
        "object": "chat.completion" if p.chat else "text_completion",
        "created": p.created,
        "model": p.model,
        "choices": choices,
        "usage": p.run.usage.as_dict(),
    }


def _full_choice(p: Prepared, index: int, events: list[ChoiceEvent]) -> dict:
    text = "".join(e.text for e in events)
    finish = p.run.finish_reasons.get(index)
    tokenizer = p.run.tokenizer
    if p.chat:
        logprobs = merge_logprobs([chat_logprobs(tokenizer, e.logprobs) for e in events], chat=True)
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
    parts, offset = [], 0
    for e in events:
        parts.append(completion_logprobs(tokenizer, e.logprobs, offset))
        offset += len(e.text)
    return {
        "index": index,
        "text": text,
        "logprobs": merge_logprobs(parts, chat=False),
        "finish_reason": finish,
    }


def engine_failure(e: Exception) -> APIError:
    return APIError(503, f"The engine failed while serving this request: {e}")
