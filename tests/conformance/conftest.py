"""The conformance suite: the official ``openai`` client (and plain HTTP where the client has
no method) against a real ``specserve serve`` process, written from the OpenAI API reference
and vLLM's documented behaviour rather than from our code.

Two servers for the whole suite: an open one (the defaults: every origin allowed, no keys)
and a locked one (one allowed origin, credentials, an API key, a small body limit).
"""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny"
API_KEY = "conformance-key"
ALLOWED_ORIGIN = "http://allowed.example"
CHAT = [{"role": "user", "content": "Say something."}]


def _start(tiny_chat_model_dir, tmp_path_factory, *extra: str):
    from tests.server_process import ServerProcess

    proc = ServerProcess(
        "--model",
        str(tiny_chat_model_dir),
        "--served-model-name",
        MODEL,
        *extra,
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="package")
def server(tiny_chat_model_dir, tmp_path_factory):
    proc = _start(tiny_chat_model_dir, tmp_path_factory)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def locked_server(tiny_chat_model_dir, tmp_path_factory):
    proc = _start(
        tiny_chat_model_dir,
        tmp_path_factory,
        "--api-key",
        API_KEY,
        "--allowed-origins",
        f'["{ALLOWED_ORIGIN}"]',
        "--allow-credentials",
        "--max-body-bytes",
        "4096",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(**kw):
    return {"temperature": 0, "max_tokens": 8, **kw}
