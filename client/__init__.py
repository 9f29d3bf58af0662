"""Client library for the paged_llm model (see client/streaming.py) and its CLI (python -m client)."""
from client.streaming import (Delta, Result, ServerError, acollect, api_key_of, collect, generate,
                              grpc_stream, grpc_stream_async, http_stream, openai_stream, triton_headers)

__all__ = ["Delta", "Result", "ServerError", "acollect", "api_key_of", "collect", "generate",
           "grpc_stream", "grpc_stream_async", "http_stream", "openai_stream", "triton_headers"]
