"""specserve's engine: model, paged KV cache, scheduler, sampler and the offline API.

Exports resolve lazily so that light commands (``specserve pull``) do not import torch.
"""

from engine.lazy_exports import lazy_exports

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

__getattr__ = lazy_exports("engine", _EXPORTS)
