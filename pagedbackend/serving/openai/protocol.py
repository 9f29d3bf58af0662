"""The OpenAI wire format for the API (``app``): request schemas, error objects,
the request mapped to sampling parameters (``pagedbackend.serving.requests``,
the one mapping of every front end), and the mapping of the
model's ``logprobs`` output (NVIDIA vllm_backend's format) to OpenAI's shapes.

Pure data: no network, no Triton, no tokenizer.
"""
import json
import re
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from pagedbackend.errors import InvalidRequestError
from pagedbackend.serving.openai.chat_content import template_content
from pagedbackend.serving.openai.token_ids import check_token_ids
from pagedbackend.serving.requests import EngineRequest, RequestLimits, map_request, openai_fields
from pagedbackend.structured.params import MAX_SCHEMA_DEPTH, text_depth

MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's chat limit
# Nesting of a request body (objects and arrays), checked before it is decoded:
# a JSON schema (at most MAX_SCHEMA_DEPTH levels) and the request around it.
MAX_BODY_DEPTH = MAX_SCHEMA_DEPTH + 32


class OpenAIError(Exception):
    """A request the API answers with an error object and an HTTP status."""

    TYPES = {404: "not_found_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- requests

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions, with vLLM's extra
    sampling fields (sent by the openai SDK through ``extra_body``)."""
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    # accepted and ignored, as they change nothing in the output
    user: Optional[str] = None
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # vLLM's extra sampling parameters
    best_of: Optional[int] = Field(None, ge=1)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    allowed_token_ids: Optional[List[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    # vLLM's: prefix-cache blocks shared only with the same salt (a non-empty string)
    cache_salt: Optional[str] = Field(None, min_length=1)
    priority: Optional[StrictInt] = None   # vLLM's: lower first under scheduling_policy=priority; not a bool
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # object and its older guided_* fields (structured.py)
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    guided_json_object: Optional[bool] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    def check(self) -> None:
        """Refusals that a field's type cannot say."""
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(_GenerationRequest):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    # OpenAI's default for completions; 0 with echo scores the prompt only
    max_tokens: Optional[int] = Field(16, ge=0)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Optional[str] = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens 0 generates nothing: it needs echo (to score the prompt)",
                              "max_tokens")

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities) alone."""
        return self.max_tokens == 0

    def prompts(self, vocab_size: Optional[int] = None) -> List[Union[str, List[int]]]:
        """Each prompt: a string, or a list of token ids (each in ``[0, vocab_size)`` when that is given)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        for i, ids in enumerate(prompts):
            if vocab_size is not None and not isinstance(ids, str):
                openai_checked(check_token_ids, ids, vocab_size, "prompt", f"[{i}]" if len(prompts) > 1 else "")
        return prompts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. tool_calls on an assistant turn, passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None

    def for_template(self, index: int) -> dict:
        """The message as a chat template expects it: text content, or parts
        with ``{"type": "image"}`` for images (``chat_content``), and the
        ``developer`` role as ``system``."""
        content, _ = openai_checked(template_content, self.content, index)
        message = self.model_dump(exclude_none=True)
        message.update(role="system" if self.role == "developer" else self.role, content=content or "")
        return message

    def image_urls(self, index: int) -> List[str]:
        """The images of the message's content parts, as sent, in order."""
        return openai_checked(template_content, self.content, index)[1]


class ChatCompletionRequest(_GenerationRequest):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True  # vLLM's name
    chat_template_kwargs: Optional[Dict[str, Any]] = None   # vLLM's: the chat template's variables
    include_reasoning: bool = True      # vLLM's: reasoning_content is returned (with a reasoning parser)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize, completions form: a prompt string."""
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        pass


class TokenizeChatRequest(_Strict):
    """vLLM's POST /tokenize, chat form: messages through the chat template."""
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_special_tokens: bool = False   # the template writes its own special tokens
    return_token_strs: bool = False

    def check(self) -> None:
        pass


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: token ids back to text."""
    model: Optional[str] = None
    tokens: List[int]

    def check(self) -> None:
        pass


def parse_request(cls, body: bytes):
    """The request body as ``cls`` (a request class, or a function of the
    decoded body that names one), or an OpenAIError naming the bad field."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else body
    except UnicodeDecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if text_depth(text) > MAX_BODY_DEPTH:   # before the recursive decoder sees it
        raise OpenAIError(400, f"the request body nests objects and arrays deeper than {MAX_BODY_DEPTH} levels "
                               f"(a JSON schema may nest at most {MAX_SCHEMA_DEPTH})")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    where = lone_surrogate(data)
    if where is not None:
        raise OpenAIError(400, f"{where or 'the request'} holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                               "without its pair), which is not a Unicode character",
                          re.split(r"[.\[]", where)[0] or None)
    if not isinstance(cls, type):
        cls = cls(data)
    try:
        request = cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check()
    return request


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value, where: str = "") -> Optional[str]:
    """The dotted path of the first string (key or value) in ``value`` that
    holds a lone surrogate (valid JSON escapes, but no character: they cannot
    be encoded as UTF-8), or None. A pair of escapes is one character already."""
    if isinstance(value, str):
        return where if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if lone_surrogate(key) is not None:
                return path
            found = lone_surrogate(item, path)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str) and not _SURROGATE.search(item):
                continue   # the common case, without building its path
            found = lone_surrogate(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first problem pydantic found, as an OpenAIError naming the field."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        message = f"unrecognized request argument: {where}"
    elif first["type"] == "missing":
        message = f"{where} is required"
    else:
        message = f"{where}: {first['msg']} (got {first.get('input')!r})"
    return OpenAIError(400, message, str(first["loc"][0]) if first["loc"] else None)


# ---------------------------------------------------------------- to the model

def sampling_parameters(request: _GenerationRequest, max_tokens: Optional[int],
                        top_logprobs: Optional[int]) -> dict:
    """The model's ``sampling_parameters`` JSON object (vLLM's names), as the
    one request mapping renames them (``pagedbackend.serving.requests``)."""
    return openai_fields(request, max_tokens, top_logprobs)


def map_openai(fields: dict, prompts: List[Union[str, List[int]]], limits: RequestLimits) -> EngineRequest:
    """``map_request`` for the OpenAI API: its refusals as 400 error objects naming the field."""
    return openai_checked(map_request, fields, prompts, limits)


def openai_checked(check, *args):
    """``check(*args)``, an ``InvalidRequestError`` becoming a 400 error object naming the field."""
    try:
        return check(*args)
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None


# ---------------------------------------------------------------- logprobs

def parse_logprobs(element) -> Optional[list]:
    """One element of the model's ``logprobs`` output: a JSON list with one
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` object per new token,
    or ``null``."""
    if element is None:
        return None
    text = element.decode("utf-8") if isinstance(element, bytes) else str(element)
    value = json.loads(text)
    if value is not None and not isinstance(value, list):
        raise ValueError(f"logprobs output must be a JSON list or null, got {type(value).__name__}")
    return value


LOGPROB_FLOOR = -9999.0   # vLLM's value for a token ruled out (-inf): answers are standard JSON


def finite(logprob: float) -> float:
    """A log-probability as a JSON answer may carry it: -inf (or NaN, which a
    model other than ours might send) as ``LOGPROB_FLOOR``."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _position(entries: dict, top: int) -> Tuple[Tuple[str, float], List[Tuple[str, float]]]:
    """The sampled token and the ``top`` most likely ones at one position.

    A position holds the ``top`` most likely tokens and the sampled one, which
    may be among them. When it is not, it is the one entry ranked below
    ``top``, wherever it stands; when it is, it must be the first entry, as
    vLLM (and so vllm_backend) writes it."""
    if not entries:
        raise ValueError("a logprobs position has no tokens")
    items = [(str(e["decoded_token"]), finite(float(e["logprob"])), e.get("rank")) for e in entries.values()]
    below = [item for item in items if item[2] is not None and item[2] > top]
    sampled = below[0] if len(items) > top and len(below) == 1 else items[0]
    by_rank = sorted(items, key=lambda item: (item[2] if item[2] is not None else float("inf"), -item[1]))
    return sampled[:2], [item[:2] for item in by_rank[:top]]


def prompt_completion_logprobs(first_token: str, positions: List[Optional[dict]], top: int) -> dict:
    """Completions ``logprobs`` of an echoed prompt: its first token (``first_token``,
    with no log-probability, as OpenAI and vLLM give it), then one entry per
    later prompt token from the model's ``prompt_logprobs`` output."""
    rest = completion_logprobs(positions[1:], top, len(first_token))
    return {"tokens": [first_token] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def completion_logprobs(positions: List[dict], top: int, text_offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per position the ``top`` most likely tokens and the
    sampled one, as vLLM does) and ``text_offset`` (each token's character
    offset in the choice's text, starting at ``text_offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for entries in positions:
        (token, logprob), best = _position(entries, top)
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**dict(best), token: logprob})
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def chat_logprobs(positions: List[dict], top: int) -> List[dict]:
    """OpenAI chat ``logprobs.content``: per token its text, log-probability,
    UTF-8 bytes and the ``top`` most likely tokens."""
    content = []
    for entries in positions:
        (token, logprob), best = _position(entries, top)
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                         for t, lp in best]})
    return content
