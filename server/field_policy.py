"""Request fields that specserve does not implement: refused with a 400 that names them.

A client that asks for something (JSON output, tools, beam search) and gets free text with a
200 has been lied to; so every field of the OpenAI API and of vLLM's extensions that we do
not honour is listed here with why, and a request that gives it a value other than its
neutral one (the value that asks for nothing: ``use_beam_search: false``, ``tools: []``,
``tool_choice: "none"``) is refused. Fields that no API we follow defines are
refused too, with OpenAI's own message ("Unrecognized request argument supplied"); explicit
nulls count as absent everywhere. The README's compatibility table is checked against
``REFUSED`` by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.errors import APIError


@dataclass(frozen=True)
class Refusal:
    reason: str  # completes "`field` is not supported: ..."
    neutral: Callable[[Any], bool] = lambda value: False  # values that ask for nothing


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


def _empty(value: Any) -> bool:
    return value in ([], {}, "")


_NO_TOOLS = "tool calling is not implemented"

REFUSED: dict[str, Refusal] = {
    # OpenAI fields
    "tools": Refusal(_NO_TOOLS, _empty),
    "tool_choice": Refusal(_NO_TOOLS + " (only 'none')", _is("none")),
    "functions": Refusal(_NO_TOOLS, _empty),
    "function_call": Refusal(_NO_TOOLS + " (only 'none')", _is("none")),
    "audio": Refusal("audio output is not implemented"),
    "modalities": Refusal("only ['text']", lambda v: v == ["text"]),
    "prediction": Refusal("predicted outputs are not implemented"),
    "web_search_options": Refusal("web search is not implemented"),
    "reasoning_effort": Refusal("the model is not a reasoning model"),
    "verbosity": Refusal("the model has no verbosity setting"),
    "store": Refusal("specserve stores no completions (only false)", _is(False)),
    "service_tier": Refusal("there is one tier (only 'auto' or 'default')", _is("auto", "default")),
    "suffix": Refusal("insertion (text after the completion) is not implemented", _empty),
    "prompt_cache_retention": Refusal(
        # The openai SDK spells it "in_memory", OpenAI's API reference "in-memory".
        "the prefix cache keeps blocks in memory while they fit (only 'in_memory')",
        _is("in_memory", "in-memory"),
    ),
    # vLLM extensions
    "use_beam_search": Refusal("beam search is not implemented", _is(False)),
    "length_penalty": Refusal("it only applies to beam search (only 1.0)", _is(1.0, 1)),
    "guided_decoding_backend": Refusal(
        "the grammar engine is llguidance (only 'auto' or 'guidance')", _is("auto", "guidance")
    ),
    "structural_tag": Refusal("structural tags (tool-call formats) are not implemented"),
    "bad_words": Refusal(
        "vLLM's bad_words matches token sequences; specserve's banned_words matches words on "
        "the text (use it instead)",
        _empty,
    ),
    "allowed_token_ids": Refusal("restricting the vocabulary is not implemented"),
    "include_stop_str_in_output": Refusal(
        "stop strings are always left out of the output (only false)", _is(False)
    ),
    "skip_special_tokens": Refusal("special tokens are always skipped (only true)", _is(True)),
    "spaces_between_special_tokens": Refusal(
        "special tokens are always skipped (only true)", _is(True)
    ),
    "logits_processors": Refusal("custom logits processors are not loaded by this server"),
    "return_tokens_as_token_ids": Refusal("logprobs name tokens by their text", _is(False)),
    "return_token_ids": Refusal("token ids are not returned (only false)", _is(False)),
    "priority": Refusal("requests are served first come, first served (only 0)", _is(0)),
    "request_id": Refusal("response ids are chosen by the server"),
    "chat_template": Refusal(
        "the model's own template is used (vLLM, too, runs a request's template only when "
        "started with --trust-request-chat-template)"
    ),
    "documents": Refusal("the chat template gets no documents"),
    "mm_processor_kwargs": Refusal("the model takes text only"),
    "prompt_embeds": Refusal("prompts are text or token ids"),
    "cache_salt": Refusal("the prefix cache has no per-request salt"),
    "kv_transfer_params": Refusal("there is no disaggregated prefill"),
    "vllm_xargs": Refusal("no extension arguments are defined"),
}


def check_extra_fields(extra: dict[str, Any] | None, where: str = "") -> None:
    """Raise a 400 for the first refused field given a value that asks for something, or
    for every field no API we follow defines (``where`` prefixes nested parameter names)."""
    unknown = []
    for name, value in (extra or {}).items():
        refusal = REFUSED.get(name)
        if refusal is None:
            unknown.append(where + name)
        elif not refusal.neutral(value):
            raise APIError(
                400,
                f"`{where}{name}` is not supported: {refusal.reason}",
                param=where + name,
                code="unsupported_parameter",
            )
    if unknown:
        raise APIError(
            400,
            f"Unrecognized request argument supplied: {', '.join(unknown)}",
            param=unknown[0],
            code="unrecognized_argument",
        )
