"""The specserve command line, run as a real process on the real SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SPECSERVE = [sys.executable, "-m", "tooling.cli"]


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


def test_bench_serve_measures_a_running_server_under_its_own_model_name(tiny_server):
    # tiny_server answers to "tiny", not to the name the bench gives the servers it starts.
    result = subprocess.run(
        [
            *SPECSERVE, "bench", "serve", "--url", tiny_server.url, "--no-baseline",
            "--concurrency", "1", "--requests", "2", "--max-tokens", "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| specserve |"))
    assert int(row.strip("|").split("|")[1]) > 0  # output tokens


def test_bench_serve_compares_a_decoder_on_a_running_server(tiny_chat_model_dir, tmp_path):
    from tests.server_process import ServerProcess

    def compare(url: str, method: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                *SPECSERVE, "bench", "serve", "--url", url, "--model", str(tiny_chat_model_dir),
                "--compare", method, "--concurrencies", "1", "--requests-per-stream", "1",
                "--max-tokens", "4", "--rounds", "1",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip

    server = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--served-model-name", "tiny-ngram",
        "--extra-decoders", "ngram", log_path=tmp_path / "server.log",
    )  # fmt: skip
    try:
        server.wait_ready()
        result = compare(server.url, "ngram")
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"the server at {server.url}" in result.stdout
        (row,) = [line for line in result.stdout.splitlines() if line.startswith("| 1 ")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0  # tok/s of both methods
        assert cells[6].endswith(")") and cells[3].endswith("x")  # the ratios
        # A method the server did not load is refused before any load runs.
        refused = compare(server.url, "eagle")
        assert refused.returncode != 0 and "does not load 'eagle'" in refused.stderr
        assert "| streams |" not in refused.stdout
    finally:
        server.stop()


def test_bench_serve_compares_a_decoder_across_concurrencies(tiny_chat_model_dir):
    result = subprocess.run(
        [
            *SPECSERVE, "bench", "serve", "--model", str(tiny_chat_model_dir),
            "--compare", "ngram", "--concurrencies", "1,2", "--requests-per-stream", "1",
            "--max-tokens", "4", "--rounds", "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )  # fmt: skip
    assert "3 alternating rounds per method" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        plain, spec, ratio = float(cells[1]), float(cells[2]), cells[3]
        assert plain > 0 and spec > 0 and ratio.endswith("x")
        assert abs(float(ratio[:-1]) - spec / plain) < 0.02  # from the unrounded rates
        assert cells[4].count("/") == 1 and cells[5].count("/") == 1  # ITL p50 / p99
        plain_p99, spec_p99 = (float(cells[i].split("/")[1]) for i in (4, 5))
        # The ratio comes from the unrounded p99s, shown to 0.1 ms: it lies between the ratios
        # of what they could have been (and is itself shown to 0.01).
        ratio, spread = cells[6].split(" ")
        low_p99 = (spec_p99 - 0.05) / (plain_p99 + 0.05)
        high_p99 = (spec_p99 + 0.05) / max(plain_p99 - 0.05, 1e-9)
        assert low_p99 - 0.005 <= float(ratio.rstrip("x")) <= high_p99 + 0.005
        # Over the 3 rounds ("(-)" when no round had gaps, e.g. one chunk per stream).
        if spread != "(-)":
            low, high = (float(v) for v in spread.strip("()").split("-"))
            assert 0 <= low <= high
        # Per token: every chunk carried usage so far, so each gap was shared among its tokens.
        assert cells[7].count("/") == 1 and cells[8].count("/") == 1
        assert cells[9].split(" ")[0].endswith("x") and "nan" not in row
        # The policy's share of plain steps and mean draft length ("-" if it never chose).
        assert (cells[10], cells[11]) == ("-", "-") or (
            cells[10].endswith("%") and 0 <= float(cells[11]) <= 4
        )
        # Autoregressive decoding against itself over the 3 rounds: "tok/s ratio / p99 ratio".
        # (A p99 ratio is "-" where a half had no gaps to compare.)
        itself = cells[12].split(" / ")
        assert len(itself) == 2 and float(itself[0].rstrip("x")) > 0
        assert itself[1] == "-" or float(itself[1].rstrip("x")) > 0


def test_bench_offline_decoder_reports_speedup_identity_and_plot(tiny_chat_model_dir, tmp_path):
    plot = tmp_path / "decoders.png"
    result = subprocess.run(
        [
            *SPECSERVE,
            "bench",
            "offline",
            "--decoder",
            "ngram,draft-int8",
            "--model",
            str(tiny_chat_model_dir),
            "--max-tokens",
            "6",
            "--prompts-per-set",
            "1",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    by_method = {(c[0], c[1]): c for c in cells}
    for prompts in ("chat", "grounded"):
        for method in ("autoregressive", "ngram", "draft-int8"):
            row = by_method[(prompts, method)]
            assert row[6] == "yes"  # identical to autoregressive
            assert float(row[3].rstrip("x")) > 0 and "+" in row[8]  # speedup; step costs
        assert (prompts, "transformers assistant_model=bf16 copy") in by_method
    assert "target forward pass after" in result.stdout
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_bench_decoders_alias_runs_the_same_comparison(tiny_chat_model_dir):
    result = subprocess.run(
        [
            *SPECSERVE,
            "bench",
            "decoders",
            "--decoders",
            "ngram",
            "--model",
            str(tiny_chat_model_dir),
            "--no-hf",
            "--max-tokens",
            "4",
            "--prompts-per-set",
            "1",
            "--plot",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "| grounded | ngram |" in result.stdout and "plot:" not in result.stdout


def test_a_chunk_s_gap_is_shared_among_the_tokens_it_covers():
    from tooling.bench.bench_serve import shared_gaps

    assert shared_gaps(0.012, 3) == [0.004, 0.004, 0.004]  # a drafted step: three tokens
    assert shared_gaps(0.005, 1) == [0.005]
    # Text with no new token (held back by the detokenizer, sent with the next) is one gap.
    assert shared_gaps(0.005, 0) == [0.005]


def test_streams_that_ask_for_usage_carry_the_server_s_own_count(tiny_server):
    import asyncio

    from tooling.bench.bench_serve import PER_TOKEN_USAGE, run_load

    extra = {**PER_TOKEN_USAGE, "ignore_eos": True}
    load = asyncio.run(run_load("tiny", tiny_server.url, "tiny", 2, 2, 6, extra))
    for result in load.results:
        assert result.completion_tokens == 6
        # Every token after the first chunk has its share of a gap.
        assert 1 <= len(result.token_gaps) <= 5 and all(g > 0 for g in result.token_gaps)


def test_output_tokens_are_the_server_s_count_when_every_stream_has_one(tiny_chat_model_dir):
    from engine.tokenizer_files import load_tokenizer
    from tooling.bench.bench_serve import LoadResult, StreamResult

    tokenizer = load_tokenizer(tiny_chat_model_dir)
    text = "Hello there, friend."
    retokenized = len(tokenizer.encode(text, add_special_tokens=False))
    counted = [StreamResult(0.1, [], text, [], 7), StreamResult(0.1, [], text, [], 5)]
    assert LoadResult("x", 1.0, counted).output_tokens(tokenizer) == 12
    # One stream without usage (a server that does not send it): the text, re-tokenized.
    mixed = [StreamResult(0.1, [], text, [], 7), StreamResult(0.1, [], text)]
    assert LoadResult("x", 1.0, mixed).output_tokens(tokenizer) == 2 * retokenized


def test_the_sweep_sets_a_load_against_itself_later_rounds_over_earlier():
    from tooling.bench.bench_serve import SweepRound, SweepRow

    def rounds(*specs):
        return [SweepRound(tokens, seconds, [], gaps) for tokens, seconds, gaps in specs]

    row = SweepRow()
    assert row.against_itself() == "-"  # no rounds
    row.rounds = rounds((100, 1.0, [0.010, 0.012]))
    assert row.against_itself() == "-"  # one round: nothing to set it against
    # Round 2 (90 tokens a second, p99 15 ms) over rounds 1 and 3 (100 tokens a second, p99
    # 12 ms).
    row.rounds = rounds((100, 1.0, [0.010, 0.012]), (90, 1.0, [0.011, 0.015]), (50, 0.5, [0.012]))
    assert row.against_itself() == "0.90x / 1.25x"
    # A half without per-token gaps has no p99 to compare: "-", not "0.00x" or "nanx".
    row.rounds = rounds((100, 1.0, []), (100, 1.0, [0.011]))
    assert row.against_itself() == "1.00x / -"
    # A tiny p99 against a large one still reads as a number.
    row.rounds = rounds((100, 1.0, [0.5]), (100, 1.0, [0.001]))
    assert row.against_itself() == "1.00x / 0.002x"


def test_the_sweep_s_round_spread_skips_rounds_without_gaps():
    from tooling.bench.bench_serve import _spread

    assert _spread([1.2]) == "(1.20-1.20)"
    assert _spread([0.004, 1.5]) == "(0.004-1.50)"
    assert _spread([]) == "(-)"


def test_a_server_interrupted_while_it_loads_is_stopped_not_left_behind(tmp_path, monkeypatch):
    import time

    import tooling.bench.bench_serve as bench_serve

    pid_file = tmp_path / "pid"
    sleeper = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )

    def interrupt(*args, **kwargs):  # Ctrl-C in the wait for /health, the server running
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_serve.httpx, "get", interrupt)
    url = f"http://127.0.0.1:{bench_serve.free_port()}"
    with pytest.raises(KeyboardInterrupt):
        bench_serve.start_server([sys.executable, "-c", sleeper], url, str(tmp_path / "log"))
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
