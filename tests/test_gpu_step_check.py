"""tooling/bench/gpu_step_check.sh: the script a lent GPU runs in one call must not fail there
for a renamed flag or a moved test, and must fit the call."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tooling.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tooling" / "bench" / "gpu_step_check.sh"
VALUES = {"$DEVICE": "cuda", "$STEPS": "32", "$MAX_TOKENS": "128"}
CALL_LIMIT_S = 600  # the device tool's limit on one command


def _steps() -> list[tuple[str, int, list[str]]]:
    """(name, timeout, command) of each ``step`` line, continuations joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        if line.startswith("step "):
            for name, value in VALUES.items():
                line = line.replace(f'"{name}"', value)
            _, name, seconds, *command = shlex.split(line)
            steps.append((name, int(seconds), command))
    return steps


def test_every_specserve_command_parses():
    commands = [command for _, _, command in _steps() if command[0] == "specserve"]
    assert len(commands) >= 3
    for command in commands:
        args = build_parser().parse_args(command[1:])  # exits (fails the test) on a bad flag
        assert args.command == "bench"


def test_the_tests_it_runs_exist_and_the_steps_fit_one_call():
    steps = _steps()
    pytest_args = next(command for name, _, command in steps if name == "tests")
    for path in (a for a in pytest_args if a.startswith("tests/")):
        assert (REPO / path).is_file(), path
    assert sum(seconds for _, seconds, _ in steps) <= CALL_LIMIT_S - 30  # start-up and copies
    assert re.search(r"command=\(python3 -m tooling\.cli ", SCRIPT.read_text())  # bench: tooling
