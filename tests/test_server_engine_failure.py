"""A server whose engine cannot run exits with status 1 and says why, instead of answering 503
forever: when the engine fails to start (a bad config fails the same way on every try), and
when it has died more often than ``--max-engine-restarts`` allows (vLLM's server exits too;
Kubernetes or Ray Serve then restarts or replaces it)."""

from __future__ import annotations

import os
import signal

import httpx

from tests.server_process import ServerProcess


def test_an_engine_that_fails_to_start_ends_the_server(tiny_chat_model_dir, tmp_path):
    server = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--decoder", "eagle3",
        "--drafter", str(tmp_path / "no-such-drafter"), log_path=tmp_path / "server.log",
    )  # fmt: skip
    try:
        assert server.proc.wait(timeout=120) == 1
        log = server.log_tail(20000)
        assert "engine failed to start" in log and "no-such-drafter" in log
        assert "error: engine failed to start" in log  # the last word, on stderr
    finally:
        server.stop()


def test_a_server_out_of_engine_restarts_ends_its_streams_and_exits(tiny_chat_model_dir,
                                                                    tmp_path):  # fmt: skip
    server = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--max-engine-restarts", "0",
        log_path=tmp_path / "server.log",
    )  # fmt: skip
    try:
        server.wait_ready()
        body = {"model": str(tiny_chat_model_dir), "prompt": "x", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            (engine,) = server.engine_pids()
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        assert server.proc.wait(timeout=60) == 1
        assert "gave up after 0 restarts" in server.log_tail(20000)
    finally:
        server.stop()
