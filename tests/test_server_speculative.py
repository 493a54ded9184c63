"""A server with several decoders loaded: per-request choice over SSE and WebSocket, spec
metrics labelled by decoder, constrained requests streamed with drafts."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import websockets

from tests.server_process import ServerProcess

MODEL = "tiny"
# Repetitive text: prompt lookup finds matches, so drafts are proposed and accepted.
PROMPT = "one two three four five " * 8
MODEL_DRAFTERS = ("draft", "layerskip", "hierarchical")


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    config = tmp / "config.yaml"
    # min 1: a random model's text rarely repeats 2-grams, but its greedy loops repeat tokens.
    config.write_text(
        "decoder:\n  method: autoregressive\n  prompt_lookup_min: 1\n  draft_policy: fixed\n"
        "  layerskip:\n    skip_mlp: [1]\n"
    )
    args = ["--config", str(config), "--model", str(tiny_chat_model_dir)]
    args += ["--served-model-name", MODEL, "--decoder", "ngram", "--num-speculative-tokens", "3"]
    args += ["--extra-decoders", ",".join(MODEL_DRAFTERS)]
    env = {"SPECSERVE_SPEC_LOG_INTERVAL_S": "0.5"}
    proc = ServerProcess(*args, env=env, log_path=tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def request_body(**extra) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 40}
    return {**body, "ignore_eos": True, **extra}


def complete(server, **extra):
    return httpx.post(server.url + "/v1/completions", json=request_body(**extra), timeout=60)


def spec_metric(server, name: str, decoder: str = "ngram") -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    label = f'decoder="{decoder}"'
    line = next(
        li for li in text.splitlines() if li.startswith(f"specserve:{name}{{") and label in li
    )
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


@pytest.mark.parametrize("method", ["ngram", *MODEL_DRAFTERS])
def test_per_request_choice_streams_over_sse(server, method):
    plain = complete(server, speculative={"method": "autoregressive"}).json()
    runs = spec_metric(server, "spec_decode_num_drafts_total", method)
    body = request_body(stream=True, speculative={"method": method})
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == plain["choices"][0]["text"]
    assert spec_metric(server, "spec_decode_num_drafts_total", method) > runs


def stream_completion(server, body: dict) -> str:
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


FLAG_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_requests_stream_with_speculation(server, method):
    """A JSON schema and banned words over SSE with drafts: the streamed text keeps to the
    constraint and equals autoregressive decoding's, and the decoder did draft."""
    (one,) = httpx.post(
        server.url + "/tokenize", json={"model": MODEL, "prompt": " one"}, timeout=10
    ).json()["tokens"]
    tempted = {"prompt": PROMPT, "logit_bias": {str(one): 9.0}, "max_tokens": 24}
    free = complete(server, **tempted, speculative={"method": "autoregressive"}).json()
    assert " one" in free["choices"][0]["text"]  # the bias does tempt
    runs = spec_metric(server, "spec_decode_num_drafts_total", method)
    for extra in ({"guided_json": FLAG_SCHEMA}, {**tempted, "banned_words": ["one"]}):
        body = request_body(**{"ignore_eos": False, "max_tokens": 48, **extra})
        plain = complete(server, **{**body, "speculative": {"method": "autoregressive"}}).json()
        streamed = stream_completion(
            server, {**body, "stream": True, "speculative": {"method": method}}
        )
        assert streamed == plain["choices"][0]["text"]
        if "guided_json" in extra:
            assert plain["choices"][0]["finish_reason"] == "stop"
            document = json.loads(streamed)
            assert set(document) == {"ok", "n"} and document["n"] in (1, 2, 3)
        else:
            assert not re.search(r"(?<!\w)one(?!\w)", streamed, flags=re.IGNORECASE)
    assert spec_metric(server, "spec_decode_num_drafts_total", method) > runs


def test_unloaded_decoder_is_a_400_listing_the_loaded_ones(server):
    r = complete(server, stream=True, speculative={"method": "eagle"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "speculative.method"
    assert "autoregressive, ngram, draft, layerskip, hierarchical" in err["message"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_over_websocket(server, method):
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
                        "speculative": {"method": method},
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


def test_sampled_requests_with_a_model_drafter_complete(server):
    """Sampling goes through the general-q rejection rule; a seed makes it repeatable."""
    runs = spec_metric(server, "spec_decode_num_drafts_total", "draft")
    extra = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "speculative": {"method": "draft"}}
    first = complete(server, **extra).json()
    second = complete(server, **extra).json()
    assert first["usage"]["completion_tokens"] == 40
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert spec_metric(server, "spec_decode_num_drafts_total", "draft") > runs


def test_acceptance_is_logged_per_decoder(server):
    complete(server, speculative={"method": "draft"})
    log_path = server.log_path
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [li for li in log_path.read_text().splitlines() if "decoder=draft" in li]
        if lines:
            break
        time.sleep(0.2)
    assert lines, "no spec decode log line for the draft decoder"
    assert "mean_acceptance_length=" in lines[-1] and "acceptance_rate=" in lines[-1]


def test_spec_log_lines_report_the_interval_only():
    from server.spec_log import spec_log_lines

    before = {"draft": (10, 40, 30, (9, 8, 7, 6))}
    after = {"draft": (14, 56, 40, (12, 11, 9, 8)), "ngram": (0, 0, 0, ())}
    (line,) = spec_log_lines(before, after)
    assert "decoder=draft drafts=4 draft_tokens=16 accepted=10" in line
    assert "acceptance_rate=0.625 mean_acceptance_length=3.50" in line
    assert "per_position_acceptance=[0.75, 0.75, 0.50, 0.50]" in line
    assert spec_log_lines(after, after) == []
