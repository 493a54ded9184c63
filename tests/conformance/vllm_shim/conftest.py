"""The root conftest of a run of vLLM's entrypoint tests against specserve.

vLLM's test modules import vLLM's own classes at the top (request models, exceptions, the
tokenizer registry) though most of their tests only speak HTTP. vLLM is not installed here, so
every ``vllm`` module resolves to stand-ins: importing one works, and a test that *uses* one
fails with ``VllmInternal``, which the runner reports as a test of vLLM's internals, not of the
API (it does not count for or against specserve). Stand-ins are exception classes too, so a
module's ``pytest.raises(VLLMValidationError)`` is well formed.

Three stand-ins do something, each for the model actually served (the runner serves it under
the name each test module asks for): ``get_tokenizer`` returns its tokenizer and
``ModelConfig(...).get_vocab_size()`` its vocabulary size, whatever model they name; the hub
download of a LoRA adapter (``hf_api().snapshot_download``), which several modules' server
fixtures run before starting the server, returns a path that names no files. specserve serves
no LoRA adapters (the shim's server drops vLLM's ``--lora-modules``), so the requests naming an
adapter get a 404 and the other tests run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path


class VllmInternal(Exception):
    """A test used one of vLLM's own classes or functions."""


class _StandIn(type):
    def __call__(cls, *args, **kwargs):
        if cls.__qualname__ in _WORKING:
            return _WORKING[cls.__qualname__](*args, **kwargs)
        raise VllmInternal(f"{cls.__qualname__}: vLLM's own code, not its HTTP API")

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")


def _stand_in(qualname: str) -> type:
    return _StandIn(qualname.rsplit(".", 1)[-1], (Exception,), {"__qualname__": qualname})


class _NoHub:
    def snapshot_download(self, repo_id: str, **kwargs) -> str:
        return f"/nonexistent/lora/{repo_id}"  # never read: the adapters are not served


def _served_tokenizer(*args, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.environ["SPECSERVE_VLLM_SUITE_MODEL"])


class _ServedModelConfig:
    def __init__(self, *args, **kwargs):
        path = Path(os.environ["SPECSERVE_VLLM_SUITE_MODEL"]) / "config.json"
        self._vocab_size = json.loads(path.read_text())["vocab_size"]

    def get_vocab_size(self) -> int:
        return self._vocab_size


_WORKING = {
    "vllm.transformers_utils.repo_utils.hf_api": _NoHub,
    "vllm.tokenizers.get_tokenizer": _served_tokenizer,
    "vllm.config.ModelConfig": _ServedModelConfig,
}


class _VllmModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _stand_in(f"{spec.name}.{attr}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _VllmModules())
