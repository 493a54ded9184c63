"""OpenAI response and stream-chunk objects built from ``ChoiceEvent``s."""

from __future__ import annotations

from engine.detokenizer import token_bytes, token_text
from engine.sampling_params import SampledToken


def chat_logprobs(tokenizer, tokens: list[SampledToken] | None) -> dict | None:
    if tokens is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": token_bytes(tokenizer, token_id)}

    return {
        "content": [
            {
                **entry(t.token_id, t.logprob),
                "top_logprobs": [entry(i, lp) for i, lp in (t.top_logprobs or [])],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokenizer, tokens: list[SampledToken] | None, offset: int) -> dict | None:
    """The legacy completions shape; ``offset`` is the text length before these tokens."""
    if tokens is None:
        return None
    texts = [token_text(tokenizer, t.token_id) for t in tokens]
    offsets, position = [], offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [_completion_top(tokenizer, t) for t in tokens],
        "text_offset": offsets,
    }


def echo_completion_logprobs(tokenizer, prompt: list[int], entries: list, k: int) -> dict:
    """The echoed prompt's part of the legacy shape: null for the first token (nothing
    precedes it), then each prompt token's logprob and its top ``k`` plus itself."""
    texts = [token_text(tokenizer, t) for t in prompt]
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    logprobs, tops = [], []
    for token_id, entry in zip(prompt, entries, strict=True):
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        top = {token_text(tokenizer, i): lp for i, lp in entry.top_logprobs[:k]}
        top.setdefault(token_text(tokenizer, token_id), entry.logprob)
        logprobs.append(entry.logprob)
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _completion_top(tokenizer, t: SampledToken) -> dict[str, float]:
    """The legacy top_logprobs entry: the top tokens and, as OpenAI and vLLM do, the sampled
    one too (so up to logprobs + 1 entries, and never empty)."""
    top = {token_text(tokenizer, i): lp for i, lp in (t.top_logprobs or [])}
    top.setdefault(token_text(tokenizer, t.token_id), t.logprob)
    return top


def prompt_logprobs_json(tokenizer, entries: list | None) -> list[dict | None] | None:
    """vLLM's shape: None for the first prompt token, then per token a dict keyed by token id
    (the prompt token and its top alternatives) of {"logprob", "rank", "decoded_token"}."""
    if entries is None:
        return None

    def one(entry) -> dict:
        top = {
            str(token_id): {
                "logprob": lp,
                "rank": rank,
                "decoded_token": token_text(tokenizer, token_id),
            }
            for rank, (token_id, lp) in enumerate(entry.top_logprobs, start=1)
        }
        top.setdefault(
            str(entry.token_id),
            {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": token_text(tokenizer, entry.token_id),
            },
        )
        return top

    return [None if e is None else one(e) for e in entries]


def provenance_json(tokenizer, token_ids: list[int], sources: list[str]) -> list[dict]:
    """The return_provenance extension: each token's own text and its source. The choice's
    text stays the authoritative output (a character split across tokens shows in neither
    token's text alone)."""
    return [
        {"token": token_text(tokenizer, t), "source": s}
        for t, s in zip(token_ids, sources, strict=True)
    ]


def merge_logprobs(parts: list[dict | None], chat: bool) -> dict | None:
    """Concatenate the per-event logprobs of one choice for a non-streaming response."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if chat:
        return {"content": [e for p in present for e in p["content"]]}
    return {key: [v for p in present for v in p[key]] for key in present[0]}
