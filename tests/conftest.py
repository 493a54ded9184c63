"""Shared fixtures.

``smollm2_path`` is the real SmolLM2-135M-Instruct, pulled once into the specserve cache
(``$SPECSERVE_CACHE_DIR`` or ``~/.cache/specserve``); ``make test`` pulls it before pytest runs,
so here it is normally a cache hit. Tests that use it are marked ``real_model`` automatically
(deselect them with ``-m "not real_model"``).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.models.pull import pull_model

    return pull_model()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 3-layer Llama checkpoint (vocab 320) written with save_pretrained."""
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """One offline engine on the real SmolLM2, shared by the tests that only generate."""
    from engine import LLM

    return LLM(model=str(smollm2_path))
