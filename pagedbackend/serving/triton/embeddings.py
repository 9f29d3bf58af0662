"""vllm_backend's ``embedding_request`` input on the Triton model: the JSON
``{"input": ..., "pooling_params": {...}}`` read and mapped
(``serving.embeddings``), one engine request per input, and one final
response: ``text_output`` holds one element per input, each that input's
embedding as a JSON list of floats (vllm_backend's layout for one input);
``num_input_tokens`` (UINT32, per input) and ``num_output_tokens`` (0 per
input) when asked for. Imported only inside Triton's Python backend stub.
"""
import json
import uuid
from typing import List, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedbackend.errors import InvalidRequestError
from pagedbackend.serving.embeddings import EmbeddingRequest, check_runner, parse_embedding_request
from pagedbackend.serving.requests import RequestLimits
from pagedbackend.serving.triton.io import FINAL, read_flag, read_text, send_error


def read_embedding_request(request, limits: RequestLimits, runner: str):
    """The request's ``embedding_request``, checked; None when it has none."""
    if pb_utils.get_input_tensor_by_name(request, "embedding_request") is None:
        return None
    check_runner(runner, "pooling")
    return parse_embedding_request(read_text(request, "embedding_request"), limits)


class EmbeddingJob:
    """The engine requests of one ``embedding_request``, started at once (a
    refused input refuses the whole request: those already queued are aborted)."""

    def __init__(self, engine, mapped: EmbeddingRequest, request, sender, observe=None):
        """``observe(output)``: called with each input's finished output (metrics)."""
        self.engine, self.sender, self.observe = engine, sender, observe
        self.flags = {name: bool(read_flag(request, name))
                      for name in ("return_num_input_tokens", "return_num_output_tokens")}
        self.ids: List[str] = []
        self.streams = []
        self.end_reason: Optional[str] = None   # set when the client or the server ends it early
        try:
            for prompt in mapped.inputs:
                self.ids.append(uuid.uuid4().hex)
                self.streams.append(engine.add_request(self.ids[-1], prompt, mapped.pooling))
        except BaseException:
            self.abort()
            raise

    def abort(self, reason: Optional[str] = None) -> None:
        """Abort its engine requests; with ``reason`` (cancelled, shutting down)
        the response is that error (CANCELLED)."""
        self.end_reason = self.end_reason or reason
        for request_id in self.ids:
            self.engine.abort(request_id)

    async def respond(self) -> None:
        """Wait for every input's embedding and send the one final response."""
        outputs = []
        try:
            for stream in self.streams:
                out = None
                async for out in stream:
                    pass
                if self.end_reason is not None:
                    break
                if out is None or out.error:
                    message = out.error if out is not None else "engine stream ended without an embedding"
                    raise InvalidRequestError(message) if out is not None and out.refused else RuntimeError(message)
                if getattr(out.outputs, "embedding", None) is None:   # aborted by the engine
                    raise RuntimeError("the request ended before its embedding was computed")
                outputs.append(out)
        except Exception as exc:
            self.abort()
            send_error(self.sender, str(exc), pb_utils.TritonError.INVALID_ARG
                       if isinstance(exc, InvalidRequestError) else pb_utils.TritonError.INTERNAL)
            return
        if self.end_reason is not None:
            send_error(self.sender, self.end_reason, pb_utils.TritonError.CANCELLED)
            return
        for out in outputs if self.observe is not None else ():
            self.observe(out)   # before the answer, so a client that has it sees it counted
        self.sender.send(embedding_response(outputs, self.flags), FINAL)


def embedding_response(outputs, flags: dict):
    """One response for the inputs' outputs, in input order."""
    texts = [json.dumps(out.outputs.embedding).encode("utf-8") for out in outputs]
    tensors = [pb_utils.Tensor("text_output", np.array(texts, dtype=np.object_))]
    if flags["return_num_input_tokens"]:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array(
            [len(out.prompt_token_ids) for out in outputs], dtype=np.uint32)))
    if flags["return_num_output_tokens"]:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.zeros(len(outputs), dtype=np.uint32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)
