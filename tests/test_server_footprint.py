"""The API process stays a thin front end: after chat, completion, tokenize and constrained
requests it has still not loaded torch (the engine process runs the model)."""

from __future__ import annotations

import httpx


def test_the_api_process_never_loads_torch(tiny_server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        streamed = client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Once", "max_tokens": 4, "stream": True})  # fmt: skip
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        constrained = {**chat, "response_format": {"type": "json_object"}}
        assert client.post("/v1/chat/completions", json=constrained).status_code == 200
        assert client.post("/tokenize", json={"model": "tiny", "prompt": "Hi"}).status_code == 200
    maps = open(f"/proc/{tiny_server.proc.pid}/maps").read()
    assert "libtorch" not in maps
    engine_maps = open(f"/proc/{tiny_server.engine_pids()[0]}/maps").read()
    assert "libtorch" in engine_maps  # (the check sees torch where it is loaded)
