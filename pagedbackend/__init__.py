"""pagedbackend: PagedAttention LLM serving on NVIDIA Triton Inference Server."""
from .config import EngineConfig
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams


def __getattr__(name):
    # The engine pulls in torch and the model code; load it only when asked.
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "LLMEngine":
        from .llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from .async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(f"module 'pagedbackend' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "SamplingParams",
           "InvalidRequestError", "RequestOutput", "CompletionOutput", "EngineStats"]
