"""A server with the ngram decoder: per-request choice over SSE and WebSocket, spec metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from tests.server_process import ServerProcess

MODEL = "tiny"
# Repetitive text: prompt lookup finds matches, so drafts are proposed and accepted.
PROMPT = "one two three four five " * 8


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    config = tmp / "config.yaml"
    # min 1: a random model's text rarely repeats 2-grams, but its greedy loops repeat tokens.
    config.write_text("decoder:\n  method: autoregressive\n  prompt_lookup_min: 1\n")
    args = ["--config", str(config), "--model", str(tiny_chat_model_dir)]
    args += ["--served-model-name", MODEL, "--decoder", "ngram", "--num-speculative-tokens", "3"]
    proc = ServerProcess(*args, log_path=tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def complete(server, **extra):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 40,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def spec_metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(li for li in text.splitlines() if li.startswith(f"specserve:{name}{{"))
    assert 'decoder="ngram"' in line
    return float(line.rsplit(" ", 1)[1])


def test_per_request_choice_gives_identical_greedy_text(server):
    plain = complete(server, speculative={"method": "autoregressive"}).json()
    runs = spec_metric(server, "spec_decode_num_drafts_total")
    drafted = spec_metric(server, "spec_decode_num_draft_tokens_total")
    spec = complete(server, speculative={"method": "ngram", "num_speculative_tokens": 2}).json()
    new_runs = spec_metric(server, "spec_decode_num_drafts_total") - runs
    new_drafts = spec_metric(server, "spec_decode_num_draft_tokens_total") - drafted
    assert new_runs > 0 and new_drafts <= 2 * new_runs  # this request drafted, with k <= 2
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    default = complete(server).json()  # the server's decoder: ngram
    assert default["choices"][0]["text"] == plain["choices"][0]["text"]
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'specserve:spec_decode_num_accepted_tokens_per_pos_total{decoder="ngram",' in text


def test_per_request_choice_streams_over_sse(server):
    plain = complete(server, speculative={"method": "autoregressive"}).json()
    runs = spec_metric(server, "spec_decode_num_drafts_total")
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "speculative": {"method": "ngram"},
    }
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == plain["choices"][0]["text"]
    assert spec_metric(server, "spec_decode_num_drafts_total") > runs


def test_unloaded_decoder_is_a_400_listing_the_loaded_ones(server):
    r = complete(server, stream=True, speculative={"method": "eagle"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "speculative.method" and "autoregressive, ngram" in err["message"]


def test_speculative_over_websocket(server):
    async def main():
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(
                json.dumps(
                    {
                        "request_id": "s",
                        "model": MODEL,
                        "prompt": PROMPT,
                        "temperature": 0,
                        "max_tokens": 20,
                        "ignore_eos": True,
                        "speculative": {"method": "ngram"},
                    }
                )
            )
            chunks = []
            while (m := json.loads(await ws.recv())).get("type") != "done":
                chunks.append(m)
            return "".join(c["choices"][0]["text"] for c in chunks)

    text = asyncio.run(main())
    plain = complete(server, max_tokens=20, speculative={"method": "autoregressive"}).json()
    assert text == plain["choices"][0]["text"]
