"""vLLM's own OpenAI entrypoint tests, run against ``specserve serve``.

    python -m tests.conformance.vllm_entrypoints [--model DIR] [-k EXPR]

Takes vLLM's source distribution from PyPI (pinned by version and sha256, kept in the cache
directory; nothing of it is committed here), stages the test files of the features specserve
claims with two stand-ins of ours (``vllm_shim/``: ``tests/utils.py``'s ``RemoteOpenAIServer``
starting ``specserve serve``, and ``vllm`` modules for the imports of vLLM's own classes), runs
them with pytest and compares the outcome with ``KNOWN``: the tests that fail here and why,
which the README's compatibility section lists. Exit 0 when every other test passes and every
known one still fails (a fixed one must leave the list); tests that use vLLM's own classes
rather than HTTP are counted apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.33.0"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SHIM = Path(__file__).with_name("vllm_shim")
OPENAI = "tests/entrypoints/openai"

# The test files of features the README claims (chat, completions, logprobs, structured
# outputs, echo, usage in streams, logit bias, models, stop token ids, long prompts).
FILES = [
    f"{OPENAI}/chat_completion/test_chat.py",
    f"{OPENAI}/chat_completion/test_chat_echo.py",
    f"{OPENAI}/chat_completion/test_chat_completion.py",
    f"{OPENAI}/chat_completion/test_chat_logit_bias_validation.py",
    f"{OPENAI}/chat_completion/test_enable_force_include_usage.py",
    f"{OPENAI}/chat_completion/test_logprob_token_ids.py",
    f"{OPENAI}/completion/test_completion.py",
    f"{OPENAI}/models/test_models.py",
    f"{OPENAI}/test_chunked_prompt.py",
]
# What the staged files import besides vLLM itself (kept as vLLM ships them).
SUPPORT = [
    "tests/__init__.py",
    "tests/entrypoints/__init__.py",
    "tests/entrypoints/conftest.py",
    f"{OPENAI}/__init__.py",
    f"{OPENAI}/utils.py",
    f"{OPENAI}/chat_completion/__init__.py",
    f"{OPENAI}/completion/__init__.py",
    f"{OPENAI}/models/__init__.py",
]

# Tests that fail against specserve, by pytest node id (``*`` matches anything), and why:
# each reason is a row of the README's table "vLLM's own tests".
_MODEL = "the model's doing (SmolLM2-135M serves for the test's 0.6-7B model): "
_LORA = "LoRA adapters: specserve serves none, so the adapter's name is a 404"
_TOKEN_IDS = "`return_token_ids`: refused unless false (README, parameters)"
_ALLOWED = "`allowed_token_ids`: refused, restricting the vocabulary is not implemented"
KNOWN: dict[str, str] = {
    "*[zephyr-lora]": _LORA,
    "*/test_models.py::test_check_models": (
        "the runner serves SmolLM2 under the test's model name, so `root` names the "
        "directory served; and no LoRA adapters are listed"
    ),
    "*/test_chat.py::test_more_than_one_prompt_logprobs_chat*": _MODEL
    + "the prompt token at that position is not the model's top 1, so the entry holds k + 1 "
    "tokens, by vLLM's own rule",
    "*/test_chat.py::test_single_chat_session[HuggingFaceH4*": _MODEL
    + "the prompt's token count is the tokenizer's (the test pins zephyr's 37)",
    "*/test_completion.py::test_completion_streaming*": _MODEL
    + "it ends this 5-token answer with its end token (finish_reason stop, not length)",
    "*/test_chat.py::test_extra_fields_allowed": (
        "deliberate, as OpenAI: an unknown field in a message is a 400 (vLLM ignores it)"
    ),
    "*/test_chat.py::test_custom_role": (
        "deliberate, as OpenAI: a role OpenAI does not define is a 400 (vLLM hands it to the "
        "template)"
    ),
    "*/test_chat.py::test_long_seed": (
        "deliberate: an out-of-range seed is a 400 whose message says so in words (vLLM's "
        "carries pydantic's error type name, which the test looks for)"
    ),
    "*/test_chat.py::test_invocations": "SageMaker's `/invocations` route is not served",
    "*/test_chat_echo.py::test_*_logprobs": (
        "`top_logprobs` / `prompt_logprobs` -1 (the whole vocabulary): refused, capped at "
        "--max-top-logprobs (20, OpenAI's limit)"
    ),
    "*/test_chat_completion.py::test_kv_transfer_prompt_token_ids_*": _TOKEN_IDS,
    "*/test_completion.py::test_completion_truncation_side_controls_prompt_truncation*": (
        _TOKEN_IDS
    ),
    "*/test_chat_completion.py::test_per_request_metrics_*": (
        "vLLM's per-request `metrics` object is not sent (the same timings are on /metrics)"
    ),
    "*/test_enable_force_include_usage.py::*": (
        "`--enable-force-include-usage`: no such server flag; a stream carries usage when "
        "its request asks (`stream_options`)"
    ),
    "*/test_logprob_token_ids.py::test_logprob_token_ids_returns_requested_ids*": _ALLOWED,
    "*/test_logprob_token_ids.py::test_logprob_token_ids_stream_with_no_top_k": _ALLOWED,
    "*/test_completion.py::test_logprob_token_ids*": _ALLOWED,
    "*/test_completion.py::test_batch_completions*": (
        "`use_beam_search`: refused, beam search is not implemented"
    ),
}


@dataclass
class Outcome:
    test: str
    passed: bool
    message: str = ""

    @property
    def vllm_internal(self) -> bool:
        """Whether it failed on one of vLLM's own classes (a stand-in here), not on HTTP."""
        return "VllmInternal" in self.message or "_StandIn" in self.message


def fetch_sources(cache: Path) -> Path:
    """vLLM's sdist (once, checked against its sha256), unpacked under ``cache``."""
    root = cache / f"vllm-{VLLM_VERSION}"
    if (root / OPENAI).is_dir():
        return root
    archive = cache / f"vllm-{VLLM_VERSION}.tar.gz"
    if not archive.is_file() or _sha256(archive) != SDIST_SHA256:
        index = "https://pypi.org/simple/vllm/"
        accept = {"Accept": "application/vnd.pypi.simple.v1+json"}  # PEP 691's JSON index
        request = urllib.request.Request(index, headers=accept)
        with urllib.request.urlopen(request, timeout=60) as r:
            files = json.load(r)["files"]
        (url,) = [f["url"] for f in files if f["filename"] == archive.name]
        cache.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(url, timeout=300) as r, open(partial, "wb") as out:
            shutil.copyfileobj(r, out)
        if _sha256(partial) != SDIST_SHA256:
            raise RuntimeError(f"{url}: sha256 differs from the pinned {SDIST_SHA256}")
        partial.replace(archive)
    with tarfile.open(archive) as tar:
        prefix = f"vllm-{VLLM_VERSION}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "tests/")]
        tar.extractall(cache, members=members, filter="data")
    return root


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stage(sources: Path, run: Path) -> None:
    """vLLM's chosen test files and what they import, with our two stand-ins."""
    if run.exists():
        shutil.rmtree(run)
    for name in FILES + SUPPORT:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sources / name, run / name)
    shutil.copy(SHIM / "utils.py", run / "tests" / "utils.py")
    shutil.copy(SHIM / "conftest.py", run / "conftest.py")
    (run / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def run_tests(run: Path, model: str, extra: list[str]) -> list[Outcome]:
    junit = run / "junit.xml"
    env = {**os.environ, "SPECSERVE_VLLM_SUITE_MODEL": model,
           "SPECSERVE_VLLM_SUITE_LOGS": str(run / "logs")}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={junit}", *FILES, *extra]  # fmt: skip
    subprocess.run(cmd, cwd=run, env=env, check=False)
    return read_junit(junit)


def read_junit(junit: Path) -> list[Outcome]:
    outcomes = []
    for case in ET.parse(junit).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        test = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        message = "" if problem is None else (problem.get("message") or "") + (problem.text or "")
        outcomes.append(Outcome(test, problem is None, message))
    return outcomes


# Tests whose outcome varies from run to run here, and why: counted neither way.
VARIES: dict[str, str] = {
    "*/test_chat.py::test_structured_outputs_json_chat": _MODEL
    + "sampled, both answers are valid for the schema but sometimes with the same name",
    "*/test_chat.py::test_structured_outputs_choice_chat": _MODEL
    + "sampled, it sometimes picks the same choice when asked for another",
    "*/test_chat.py::test_response_format_json_*": _MODEL
    + "sampled, valid JSON (for the schema) but seldom the answer 2 the test expects",
    "*/test_chat.py::test_complex_message_content": _MODEL
    + "sampled, it answers '1 + 1 = 2' and the like, seldom just '2'",
    "*/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message*": _MODEL
    + "sampled with no length limit, it sometimes runs to the context length (finish_reason "
    "length, not stop)",
}


def known_reason(test: str) -> str | None:
    return next((why for pattern, why in KNOWN.items() if _matches(pattern, test)), None)


def varies(test: str) -> bool:
    return any(_matches(pattern, test) for pattern in VARIES)


def _matches(pattern: str, test: str) -> bool:
    """``*`` matches anything; every other character itself (node ids hold brackets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), test) is not None


def report(outcomes: list[Outcome]) -> int:
    api = [o for o in outcomes if not o.vllm_internal and not varies(o.test)]
    unexpected = [o for o in api if not o.passed and known_reason(o.test) is None]
    fixed = [o for o in api if o.passed and known_reason(o.test) is not None]
    known = [o for o in api if not o.passed and known_reason(o.test) is not None]
    passed = sum(o.passed for o in api)
    internal = sum(o.vllm_internal for o in outcomes)
    varying = sum(varies(o.test) for o in outcomes)
    print(f"\nvLLM {VLLM_VERSION}'s entrypoint tests against specserve: {passed} passed, "
          f"{len(known)} known differences, {len(unexpected)} unexpected failures; not "
          f"counted: {internal} use vLLM's own classes, {varying} vary from run to run")
    for o in unexpected:
        print(f"UNEXPECTED {o.test}\n    {o.message.splitlines()[0] if o.message else ''}")
    for o in fixed:
        print(f"NOW PASSES (drop it from KNOWN and the README) {o.test}")
    return 1 if unexpected or fixed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory to serve (default: the embedded one)")
    parser.add_argument("--run-dir", default=None, help="where to stage and run the tests")
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    args = parser.parse_args(argv)
    from engine.config import EngineConfig
    from engine.models.pull import cache_dir, resolve_model

    model = str(resolve_model(args.model or EngineConfig().model))
    cache = cache_dir() / "vllm-tests"
    run = Path(args.run_dir) if args.run_dir else cache / "run"
    stage(fetch_sources(cache), run)
    outcomes = run_tests(run, model, ["-k", args.select] if args.select else [])
    return report(outcomes)


if __name__ == "__main__":
    sys.exit(main())
