"""specserve's engine: model, paged KV cache, scheduler, sampler and the offline API."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
