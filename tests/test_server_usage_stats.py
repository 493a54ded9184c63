"""vLLM's stream_options on completions and chat: usage in the last chunk, usage so far in
every chunk (continuous_usage_stats), and none at all when include_usage is false, continuous
or not (vLLM's own entrypoint tests pin that last case)."""

from __future__ import annotations

import json

import httpx
import pytest


def _chunks(server, path: str, options: dict) -> list[dict]:
    body = {"model": "tiny", "max_tokens": 5, "stream": True, "stream_options": options,
            "ignore_eos": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    body |= chat if "/chat/" in path else {"prompt": "Once"}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_false_sends_no_usage_even_when_continuous(tiny_server, path):
    chunks = _chunks(tiny_server, path, {"include_usage": False, "continuous_usage_stats": True})
    assert chunks and all(chunk.get("usage") is None for chunk in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_is_in_every_chunk_and_grows(tiny_server, path):
    chunks = _chunks(tiny_server, path, {"continuous_usage_stats": True})
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == []  # the final usage chunk


def test_include_usage_alone_puts_usage_in_the_last_chunk_only(tiny_server):
    chunks = _chunks(tiny_server, "/v1/completions", {"include_usage": True})
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 5
