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


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2_path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template (vocab 49152):
    gibberish text, but every server code path (chat template, detokenizer) is real."""
    import shutil

    from tests.tiny_models import save_tiny_model

    path = save_tiny_model(
        tmp_path_factory.mktemp("tiny-chat") / "llama",
        vocab_size=49152,
        num_hidden_layers=2,
        max_position_embeddings=1024,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_path / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_chat_model_dir, tmp_path_factory):
    """``specserve serve`` on the tiny chat model, served as "tiny"; one per test module, so
    a module that counts metrics or kills the engine starts from a fresh process."""
    from tests.server_process import ServerProcess

    proc = ServerProcess(
        "--model",
        str(tiny_chat_model_dir),
        "--served-model-name",
        "tiny",
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def tiny_draft_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A separate draft model for the tiny Llama: its weights plus small noise, so that its
    greedy drafts are accepted about half the time."""
    from tests.tiny_models import save_perturbed_copy

    return save_perturbed_copy(
        tiny_model_dir, tmp_path_factory.mktemp("tiny-draft") / "llama", 0.005
    )


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op thread for the module: the tiny models' ops are too small to split, and on
    a busy machine extra threads spin-wait for cores (steps run ~50x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
