"""The specserve command line, run as a real process on the real SmolLM2."""

from __future__ import annotations

import subprocess
import sys

import pytest

SPECSERVE = [sys.executable, "-m", "server.cli"]


@pytest.mark.real_model
def test_generate_streams_text(smollm2_path):
    result = subprocess.run(
        [
            *SPECSERVE,
            "generate",
            "What is the capital of France?",
            "--chat",
            "--model",
            str(smollm2_path),
            "--max-tokens",
            "12",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in result.stdout


def test_generate_rejects_bad_sampling_flags_before_loading():
    result = subprocess.run(
        [*SPECSERVE, "generate", "hi", "--model", "no-such-model", "--top-p", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "top_p" in result.stderr


@pytest.mark.real_model
def test_bench_offline_prints_ratios_and_floor(smollm2_path):
    result = subprocess.run(
        [
            *SPECSERVE,
            "bench",
            "offline",
            "--model",
            str(smollm2_path),
            "--batch",
            "2",
            "--max-tokens",
            "6",
            "--prompt-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    out = result.stdout
    assert "memory read bandwidth" in out and "of the bandwidth floor" in out
    assert "| decode tok/s, batch 2 |" in out and "x |" in out


def test_bench_serve_reports_percentiles(tiny_chat_model_dir, tmp_path):
    result = subprocess.run(
        [
            *SPECSERVE,
            "bench",
            "serve",
            "--model",
            str(tiny_chat_model_dir),
            "--no-baseline",
            "--concurrency",
            "2",
            "--requests",
            "3",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    row = next(line for line in result.stdout.splitlines() if line.startswith("| specserve |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[1]) > 0 and float(cells[3]) > 0  # output tokens, tokens/s
    assert cells[4].count("/") == 2 and cells[5].count("/") == 2  # p50/p90/p99


def test_bench_decoders_reports_speedup_and_identity(tiny_chat_model_dir):
    result = subprocess.run(
        [
            *SPECSERVE,
            "bench",
            "decoders",
            "--model",
            str(tiny_chat_model_dir),
            "--no-hf",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    methods = {(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows}
    assert {("chat", "ngram"), ("grounded", "ngram"), ("grounded", "autoregressive")} <= methods
    assert all(r.rstrip("| ").endswith("yes") for r in rows)  # identical to autoregressive
