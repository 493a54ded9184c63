"""The llama.cpp baseline of `specserve bench offline` (tooling/bench/bench_llamacpp.py).

The real tests run llama-cpp-python on SmolLM2's GGUF file: the one in the model directory, or
``$SPECSERVE_TEST_GGUF``. They decode a few tokens and never assert timings.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from engine.models.gguf_weights import find_gguf
from tooling.bench.bench import print_table
from tooling.bench.bench_llamacpp import (
    BATCH_NOTE,
    INSTALL_NOTE,
    NO_GGUF_NOTE,
    LlamaCppFigures,
    greedy_decode,
    llamacpp_baseline,
    load_llama,
    prompt_ttft,
    run_isolated,
)

THREADS = 1


@pytest.fixture(scope="module")
def gguf(smollm2_path) -> Path:
    pytest.importorskip("llama_cpp")
    path = os.environ.get("SPECSERVE_TEST_GGUF") or find_gguf(smollm2_path)
    if path is None:
        pytest.skip("no GGUF file: set SPECSERVE_TEST_GGUF or keep it in the model directory")
    return Path(path)


@pytest.fixture(scope="module")
def llama(gguf):
    # One token per evaluation: llama.cpp's multi-token prompt evaluation crashed this test
    # process on an Intel AMX VM (the bench itself runs llama.cpp in a child process).
    llama = load_llama(gguf, THREADS, n_ctx=128, n_batch=1)
    yield llama
    llama.close()


def _prompt(llama) -> list[int]:
    return llama.tokenize(b"The capital of France is", add_bos=False)


def test_greedy_decode_returns_the_requested_tokens_from_a_fresh_cache(llama):
    tokens, rate = greedy_decode(llama, _prompt(llama), 5)
    assert len(tokens) == 5 and rate > 0
    # Greedy and a fresh KV cache each call: the same prompt gives the same tokens again.
    assert greedy_decode(llama, _prompt(llama), 5)[0] == tokens


def test_prompt_ttft_is_positive(llama):
    assert prompt_ttft(llama, _prompt(llama) * 4, repeats=2) > 0


def test_baseline_measures_batch_1_and_ttft_and_notes_batch_n(gguf):
    prompt = list(range(1000, 1016))
    figures = llamacpp_baseline(gguf, [prompt, prompt], prompt * 4, 3, THREADS, n_batch=1)
    assert figures.decode_1 > 0 and figures.ttft_s > 0
    assert figures.decode_n is None
    assert any(BATCH_NOTE in note for note in figures.notes)


def test_without_llama_cpp_the_baseline_is_a_note(monkeypatch, tmp_path):
    # Fault injection: the import fails as it does where the extra is not installed.
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    figures = llamacpp_baseline(tmp_path / "model.gguf", [[1, 2]], [1, 2, 3], 4, THREADS)
    assert figures.rows() == [None, None, None] and figures.notes == [INSTALL_NOTE]


def test_without_gguf_the_baseline_is_a_note():
    pytest.importorskip("llama_cpp")
    figures = llamacpp_baseline(None, [[1, 2]], [1, 2, 3], 4, THREADS)
    assert figures.rows() == [None, None, None] and figures.notes == [NO_GGUF_NOTE]


def test_find_gguf_wants_exactly_one_file(tmp_path):
    assert find_gguf(tmp_path) is None
    (tmp_path / "a.gguf").touch()
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").touch()
    with pytest.raises(ValueError, match="several .gguf files"):
        find_gguf(tmp_path)  # the engine's loader refuses such a directory too


def test_table_shows_dashes_and_the_note_when_llama_cpp_is_missing(capsys):
    names = ["decode tok/s, batch 1", "decode tok/s, batch 2", "TTFT s, 64-token prompt"]
    missing = LlamaCppFigures(notes=[INSTALL_NOTE])
    print_table(names, [50.0, 400.0, 0.2], [25.0, 200.0, 0.4], missing)
    out = capsys.readouterr().out
    assert "| decode tok/s, batch 1 | 50.000 | 25.000 | 2.00x | - | - |" in out
    assert "| TTFT s, 64-token prompt | 0.200 | 0.400 | 2.00x | - | - |" in out
    assert INSTALL_NOTE in out


def test_table_ratios_against_llama_cpp(capsys):
    figures = LlamaCppFigures(100.0, None, 0.1)
    print_table(["tok/s b1", "tok/s b2", "ttft"], [50.0, 400.0, 0.2], None, figures)
    out = capsys.readouterr().out
    assert "| tok/s b1 | 50.000 | - | - | 100.000 | 0.50x |" in out
    assert "| tok/s b2 | 400.000 | - | - | - | - |" in out
    assert "| ttft | 0.200 | - | - | 0.100 | 0.50x |" in out


def _crash():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_llamacpp_runs_in_a_child_whose_crash_becomes_a_note():
    assert run_isolated(LlamaCppFigures, 12.5).decode_1 == 12.5  # answers come back
    crashed = run_isolated(_crash)
    assert crashed.decode_1 is None and crashed.ttft_s is None
    assert f"exit code {-signal.SIGSEGV}" in crashed.notes[0]
