"""The runner of vLLM's own entrypoint tests (tests/conformance/vllm_entrypoints.py): its
verdict, its stand-ins for vLLM's modules, and the README's table of the tests that fail here.

The run itself (vLLM's tests against a real server on the real model, ten minutes and more on
two cores) is a command, `python -m tests.conformance.vllm_entrypoints`; these tests hold the
parts that decide what its outcome means.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conformance import vllm_entrypoints as runner
from tests.conformance.vllm_entrypoints import KNOWN, VARIES, Outcome, report

README = Path(__file__).resolve().parents[2] / "README.md"


def _ids() -> tuple[str, str, str]:
    chat = "tests/entrypoints/openai/chat_completion/test_chat.py"
    lora = f"{chat}::test_no_logprobs_chat[zephyr-lora]"
    plain = f"{chat}::test_no_logprobs_chat[x]"
    varying = (
        "tests/entrypoints/openai/chat_completion/test_chat_echo.py::"
        "test_chat_session_with_echo_and_continue_final_message[test_case0]"
    )
    return lora, plain, varying


def test_the_verdict_fails_on_an_unlisted_failure_and_on_a_listed_test_that_passes(capsys):
    lora, plain, varying = _ids()
    assert runner.known_reason(lora) is not None and runner.known_reason(plain) is None
    internal = Outcome("t.py::uses_vllm", False, "VllmInternal: vllm.config.X: vLLM's own code")
    expected = [Outcome(lora, False, "404"), Outcome(plain, True), internal,
                Outcome(varying, False, "length")]  # fmt: skip
    assert report(expected) == 0
    assert "1 passed, 1 known differences, 0 unexpected" in capsys.readouterr().out
    assert report([Outcome(plain, False, "AssertionError: boom")]) == 1
    assert f"UNEXPECTED {plain}\n    AssertionError: boom" in capsys.readouterr().out
    assert report([Outcome(lora, True)]) == 1  # fixed: it must leave the list
    assert f"NOW PASSES (drop it from KNOWN and the README) {lora}" in capsys.readouterr().out


def test_patterns_match_brackets_literally():
    assert runner._matches("*/a.py::t[x-1]", "tests/a.py::t[x-1]")
    assert not runner._matches("*/a.py::t[x-1]", "tests/a.py::tx")  # no character classes
    assert runner._matches("*::t*", "tests/a.py::t[anything]")


def test_the_readme_lists_every_reason_and_nothing_else():
    text = README.read_text()
    section = text.split("### vLLM's own tests", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    reasons = {why for why in list(KNOWN.values()) + list(VARIES.values())}
    listed = {row.split(" | ")[0].removeprefix("| ") for row in rows}
    assert listed == reasons
    for pattern in list(KNOWN) + list(VARIES):
        assert f"`{pattern.removeprefix('*/')}`" in section, pattern
    assert f"{runner.VLLM_VERSION}'s `tests/entrypoints/openai`" in section


def test_vllms_modules_are_stand_ins_that_fail_when_used(tiny_chat_model_dir):
    # In a subprocess: the stand-ins hook the import system for every `vllm` module.
    shim = Path(runner.SHIM / "conftest.py")
    code = f"""
import os, sys, runpy
os.environ["SPECSERVE_VLLM_SUITE_MODEL"] = {str(tiny_chat_model_dir)!r}
shim = runpy.run_path({str(shim)!r})
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.config import ModelConfig
from vllm.tokenizers import get_tokenizer
from vllm.transformers_utils.repo_utils import hf_api
try:
    ChatCompletionRequest(messages=[])
except Exception as e:
    print(type(e).__name__, e)
try:
    raise ValueError("x")
except VLLMValidationError:
    print("caught a ValueError")
except ValueError:
    print("an exception class: ok")
print(ModelConfig("any/model").get_vocab_size())
print(len(get_tokenizer(tokenizer_name="any/model")("hello world")["input_ids"]) > 0)
print(hf_api().snapshot_download(repo_id="typeof/zephyr-7b-beta-lora"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"VllmInternal .*ChatCompletionRequest: vLLM's own code", lines[0])
    assert lines[1] == "an exception class: ok"
    import json

    vocab = json.loads((Path(tiny_chat_model_dir) / "config.json").read_text())["vocab_size"]
    assert lines[2] == str(vocab)
    assert lines[3] == "True"
    assert lines[4] == "/nonexistent/lora/typeof/zephyr-7b-beta-lora"
