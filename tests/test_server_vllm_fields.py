"""Fields vLLM always sends, sent here too: ``prompt_logprobs`` is null when not asked for
(on a chat response, and on each completion choice), a list when asked."""

from __future__ import annotations

import httpx


def test_prompt_logprobs_is_always_there(tiny_server):
    url = tiny_server.url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert "prompt_logprobs" in body and body["prompt_logprobs"] is None
    completion = {"model": "tiny", "prompt": ["Once", "Twice"], "max_tokens": 2}
    body = httpx.post(url + "/v1/completions", json=completion, timeout=60).json()
    assert [c["prompt_logprobs"] for c in body["choices"]] == [None, None]
    asked = httpx.post(url + "/v1/completions", json={**completion, "prompt_logprobs": 1},
                       timeout=60).json()  # fmt: skip
    assert all(isinstance(c["prompt_logprobs"], list) for c in asked["choices"])
