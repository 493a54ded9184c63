"""End to end on the real SmolLM2: a streamed chat completion through the official client."""

from __future__ import annotations

import openai
import pytest

from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    proc = ServerProcess(
        "--model",
        str(smollm2_path),
        "--served-model-name",
        "smollm2",
        log_path=tmp_path_factory.mktemp("e2e") / "server.log",
    )
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        proc.stop()


def test_streamed_chat_from_smollm2_is_sensible(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text
    log = server.log_tail()
    # One log line per request, never the prompt text.
    assert "status=200" in log and "capital of France" not in log
