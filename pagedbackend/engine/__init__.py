"""The engine: ``LLMEngine`` (one step at a time), ``AsyncLLMEngine`` (its
step loop in a thread, streams per request) and the offline ``LLM``. The
engine owns the tokenizer and turns tokens into text."""
from .async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, EngineStats, Logprob, RequestOutput,
                      ScoringOutput, ScoringRequestOutput)

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineDeadError",
           "EngineStats", "LLM", "LLMEngine",
           "Logprob",
           "RequestOutput", "RequestStream", "ScoringOutput", "ScoringRequestOutput"]
