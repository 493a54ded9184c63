"""specserve's engine: model, paged KV cache, scheduler, sampler and the offline API.

Exports resolve lazily so that light commands (``specserve pull``) do not import torch.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "ConstraintSpec": "engine.constraints",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
