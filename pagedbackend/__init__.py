"""pagedbackend: PagedAttention LLM serving on NVIDIA Triton Inference Server.

Layers, bottom up: ``config`` and ``sampling_params`` (plain data),
``kernels`` and ``models`` (the forward pass), ``core`` (blocks and
scheduling) and ``sample`` (token selection), ``worker`` (the model runner and
its executors), ``engine`` (the request lifecycle and text), ``serving``
(tritonserver, the Triton model's helpers). A module imports only from layers
below its own.
"""
from .config import EngineConfig
from .lora import LoRARequest
from .pooling_params import PoolingParams
from .sampling_params import InvalidRequestError, SamplingParams
from .structured.params import StructuredOutputsParams

_ENGINE = ("LLM", "LLMEngine", "AsyncLLMEngine", "RequestOutput", "CompletionOutput", "EngineStats",
           "EmbeddingRequestOutput", "EmbeddingOutput", "ScoringRequestOutput", "ScoringOutput")


def __getattr__(name):
    # The engine pulls in torch and the model code; load it only when asked.
    if name in _ENGINE:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'pagedbackend' has no attribute {name!r}")


__all__ = ["EngineConfig", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "InvalidRequestError",
           *_ENGINE]
