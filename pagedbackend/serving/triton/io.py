"""Triton request in, Triton response out, for ``model_repository/paged_llm``.

Tensors follow the public vLLM Triton backend. Imported only inside Triton's
Python backend stub (it needs ``triton_python_backend_utils``).
"""
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedbackend.errors import InvalidRequestError
from pagedbackend.sample.sampler import finite_logprob
from pagedbackend.serving.requests import (MAX_PARAMETERS_BYTES, EngineRequest, RequestLimits, map_request,
                                           triton_fields)
from pagedbackend.serving.security import redact

FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
         "return_logprobs", "return_num_input_tokens", "return_num_output_tokens", "return_num_cached_tokens",
         "return_prompt_logprobs", "return_output_ids")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class Job:
    """One request in flight and what has been sent for it so far."""
    request_id: str
    prompt: str
    flags: dict
    sender: object
    stream: object = None
    last_token_time: Optional[float] = None   # engine clock, of the latest token sent
    cancelled: bool = False                   # by the client
    abort_reason: Optional[str] = None         # set when the server ends it (shutting down)
    triton_id: str = ""                       # the client's request id, if it gave one
    n: int = 1                                # outputs asked for
    logprobs_requested: bool = False          # sampling parameter logprobs set
    texts: dict = field(default_factory=dict)          # output index -> text so far
    ids: dict = field(default_factory=dict)            # output index -> token ids so far (if asked for)
    num_tokens: dict = field(default_factory=dict)     # output index -> tokens so far
    reasons: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)       # output index -> cumulative logprob
    token_logprobs: dict = field(default_factory=dict)  # output index -> per-token entries, or None
    prompt_logprobs: Optional[list] = None              # once the engine has sent them


def read_text(request, name: str, max_bytes: Optional[int] = None, limit: str = "") -> str:
    """One BYTES element as text; longer than ``max_bytes`` is refused before
    decoding, with ``limit`` saying what the limit is (default: the bytes)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise ValueError(f"input {name} is required")
    value = tensor.as_numpy()
    if value.dtype != np.object_ or value.size != 1:
        raise ValueError(f"input {name} must be one BYTES element, got {value.dtype} of shape {list(value.shape)}")
    value = value.reshape(-1)[0]
    if not isinstance(value, bytes):
        return str(value)
    if max_bytes is not None and len(value) > max_bytes:
        raise ValueError(f"input {name} has {len(value)} bytes; {limit or f'the limit is {max_bytes} bytes'}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"input {name} is not valid UTF-8: {exc}") from None


def read_optional_text(request, name: str, max_bytes: int = 64 * 1024):
    """An optional BYTES input as text (None when absent)."""
    if pb_utils.get_input_tensor_by_name(request, name) is None:
        return None
    return read_text(request, name, max_bytes)


def read_prompt(request, max_chars: int) -> str:
    """text_input, refused cheaply when longer than ``max_chars`` characters
    (a character is at most 4 UTF-8 bytes; the engine checks characters)."""
    return read_text(request, "text_input", 4 * max_chars,
                     f"prompts are limited to {max_chars} characters (engine setting max_prompt_chars)")


def read_prompt_or_ids(request, max_chars: int):
    """The prompt: ``text_input``, or the token ids of ``input_ids`` (INT32 or
    INT64, one dimension) when that is given instead."""
    tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if tensor is None:
        return read_prompt(request, max_chars)
    if pb_utils.get_input_tensor_by_name(request, "text_input") is not None:
        raise ValueError("give text_input or input_ids, not both")
    ids = tensor.as_numpy()
    if ids.dtype not in (np.int32, np.int64) or ids.size == 0:
        raise ValueError(f"input input_ids must be a non-empty list of INT32 or INT64 token ids, got "
                         f"{ids.dtype} of shape {list(ids.shape)}")
    return [int(t) for t in ids.reshape(-1)]


def read_flag(request, name: str) -> Optional[bool]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy()
    if value.dtype != np.bool_ or value.size != 1:
        raise ValueError(f"input {name} must be one BOOL element, got {value.dtype} of shape {list(value.shape)}")
    return bool(value.reshape(-1)[0])


def read_flags(request) -> dict:
    """The optional BOOL inputs, with the vLLM backend's echo rule: the prompt
    is echoed unless streaming, and streaming cannot echo it."""
    flags = {name: read_flag(request, name) for name in FLAGS}
    if flags["exclude_input_in_output"] is None:
        flags["exclude_input_in_output"] = bool(flags["stream"])
    elif flags["stream"] and not flags["exclude_input_in_output"]:
        raise ValueError("exclude_input_in_output=false is not allowed with stream=true")
    return flags


def read_images(request, max_images: Optional[int]) -> list:
    """The ``image`` input as vllm_backend declares it (BYTES, one element per
    image: base64, or here also a data URL or an allowed http(s) URL), not
    yet decoded; more than ``max_images`` is refused before any is decoded."""
    tensor = pb_utils.get_input_tensor_by_name(request, "image")
    if tensor is None:
        return []
    value = tensor.as_numpy()
    if max_images is not None and value.size > max_images:
        raise InvalidRequestError(f"image: {value.size} images; the limit is {max_images} per prompt "
                                  "(limit_mm_per_prompt)", param="image")
    if value.dtype != np.object_:
        raise InvalidRequestError(f"input image must be BYTES (one base64 image an element), got {value.dtype}",
                                  param="image")
    return list(value.reshape(-1))


def read_request(request, limits: RequestLimits) -> EngineRequest:
    """The request's prompt (``text_input`` or ``input_ids``), its images
    (``image``, still encoded) and its sampling parameters: the
    ``sampling_parameters`` tensor (JSON, with vllm_backend's ``lora_name``
    beside them), else the request's parameters (generate endpoint), each
    parsed once and mapped by ``map_request``."""
    prompt = read_prompt_or_ids(request, limits.max_prompt_chars)
    images = read_images(request, limits.max_images)
    if pb_utils.get_input_tensor_by_name(request, "sampling_parameters") is not None:
        fields = triton_fields(read_text(request, "sampling_parameters", MAX_PARAMETERS_BYTES))
    else:
        fields = triton_fields(None, request.parameters())
    return map_request(fields, [prompt], limits, images)


def send_error(sender, message: str, code) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(redact(message), code)), FINAL)


def send_json(sender, answer) -> None:
    """One final response whose text_output is ``answer`` as JSON (a control request's)."""
    tensor = pb_utils.Tensor("text_output", np.array([json.dumps(answer).encode("utf-8")], dtype=np.object_))
    sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]), FINAL)


def accumulate(job: Job, out) -> int:
    """Fold an engine delta into the job; returns the most new tokens of any output."""
    if out.prompt_logprobs is not None:
        job.prompt_logprobs = out.prompt_logprobs
    new_tokens = 0
    for o in out.outputs:
        job.texts[o.index] = job.texts.get(o.index, "") + o.text
        job.num_tokens[o.index] = job.num_tokens.get(o.index, 0) + len(o.token_ids)
        if job.flags["return_output_ids"]:
            job.ids.setdefault(o.index, []).extend(o.token_ids)
        job.reasons[o.index] = o.finish_reason or job.reasons.get(o.index)
        job.logprobs[o.index] = o.cumulative_logprob
        if job.flags["return_logprobs"]:
            if o.logprobs is None:
                job.token_logprobs[o.index] = None
            else:
                job.token_logprobs.setdefault(o.index, []).extend(o.logprobs)
        new_tokens = max(new_tokens, len(o.token_ids))
    return new_tokens


def prompt_logprobs_json(entries) -> bytes:
    """The prompt's log-probabilities as JSON: ``null`` for the first token, then
    per token ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the prompt
    token first); ``null`` as a whole when they are not (or not yet) given."""
    if entries is None:
        return b"null"
    return b"[null" + b"".join(b"," + logprobs_json([step])[1:-1] for step in entries[1:]) + b"]"


def logprobs_json(entries) -> bytes:
    """Per token, ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the
    sampled token first), as vllm_backend's ``logprobs`` output; ``null`` when
    the request asked for no log-probabilities (sampling parameter ``logprobs``).
    Always standard JSON: a ruled-out token's -inf is written as vLLM's -9999.0."""
    if entries is None:
        return b"null"
    return json.dumps([{str(token): {"logprob": finite_logprob(e.logprob), "rank": e.rank,
                                      "decoded_token": e.decoded_token}
                        for token, e in step.items()} for step in entries], allow_nan=False).encode("utf-8")


def build_response(job: Job, out, delta: bool):
    """A response holding, per output index, its new text (``delta``) or all of
    it (echoing the prompt unless excluded), plus the requested extra outputs."""
    changed = {o.index: o for o in out.outputs}
    if delta:  # every output, in index order (vllm_backend's layout); unchanged ones are empty
        indices = list(range(max(job.n, max(changed, default=-1) + 1)))
        parts = {i: (changed[i].text, len(changed[i].token_ids)) if i in changed else ("", 0) for i in indices}
    else:
        indices = sorted(job.texts)
        prefix = "" if job.flags["exclude_input_in_output"] else job.prompt
        parts = {i: (prefix + job.texts[i], job.num_tokens[i]) for i in indices}
    tensors = [pb_utils.Tensor("text_output", np.array(
        [parts[i][0].encode("utf-8") for i in indices], dtype=np.object_))]
    if job.flags["return_finish_reason"]:
        tensors.append(pb_utils.Tensor("finish_reason", np.array(
            [str(job.reasons.get(i)) for i in indices], dtype=np.object_)))
    if job.flags["return_cumulative_logprob"]:
        tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(
            [0.0 if job.logprobs.get(i) is None else finite_logprob(job.logprobs[i]) for i in indices],
            dtype=np.float32)))
    if job.flags["return_logprobs"]:
        if delta:
            none = [] if job.logprobs_requested else None
            steps = {i: changed[i].logprobs if i in changed else none for i in indices}
        else:
            steps = {i: job.token_logprobs.get(i) for i in indices}
        tensors.append(pb_utils.Tensor("logprobs", np.array(
            [logprobs_json(steps.get(i)) for i in indices], dtype=np.object_)))
    if job.flags["return_num_input_tokens"]:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array(
            [len(out.prompt_token_ids)], dtype=np.uint32)))
    if job.flags["return_prompt_logprobs"]:   # when streaming, in the response that first carries them
        prompt = out.prompt_logprobs if delta else job.prompt_logprobs
        tensors.append(pb_utils.Tensor("prompt_logprobs", np.array([prompt_logprobs_json(prompt)],
                                                                   dtype=np.object_)))
    if job.flags["return_num_cached_tokens"]:   # prompt tokens found in the prefix cache
        cached = out.metrics.num_cached_prompt_tokens if out.metrics is not None else 0
        tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([cached], dtype=np.uint32)))
    if job.flags["return_num_output_tokens"]:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array(
            [parts[i][1] for i in indices], dtype=np.uint32)))
    if job.flags["return_output_ids"]:   # one row per output, padded with -1
        rows = [list(changed[i].token_ids) if i in changed else [] for i in indices] if delta \
            else [job.ids.get(i, []) for i in indices]
        width = max((len(r) for r in rows), default=0)
        tensors.append(pb_utils.Tensor("output_ids", np.array(
            [r + [-1] * (width - len(r)) for r in rows], dtype=np.int64).reshape(len(rows), width)))
    return pb_utils.InferenceResponse(output_tensors=tensors)
