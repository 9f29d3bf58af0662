"""One mapping from every front end's request to what the engine takes.

The OpenAI API, Triton's own tensors (the ``sampling_parameters`` JSON or the
``generate`` endpoint's request parameters) and Dynamo's token requests each
rename their body's fields to vLLM's sampling-parameter names (a JSON object,
also what travels to the Triton model); ``map_request`` alone turns that
object into ``SamplingParams`` plus the request's inputs and checks it against
``RequestLimits``. Each body is parsed once; each parameter enters by one
route and is checked once. Pure data: no network, no Triton, no tokenizer.
"""
import dataclasses
import json
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pagedbackend.config import coerce
from pagedbackend.errors import InvalidRequestError
from pagedbackend.models.model_args import rope_positions
from pagedbackend.sampling_params import MAX_PARAMETERS_DEPTH, SamplingParams
from pagedbackend.structured.params import MAX_SCHEMA_DEPTH, text_depth

Prompt = Union[str, List[int]]
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PARAMETER_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
# The Triton model's cap on its sampling parameters (JSON), refused before parsing.
MAX_PARAMETERS_BYTES = 64 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, on every front end; a request beyond a
    limit is refused (a 4xx) naming the field, before any work is queued.
    Set on the OpenAI server by ``--request-limit NAME=VALUE`` and on the Triton
    model by the config.pbtxt parameter of the field's name in upper case."""
    max_n: int = 128                      # outputs per request (OpenAI's own limit)
    max_best_of: int = 128                # candidates per request, the beam width with beam search
    max_stop_strings: int = 64            # stop strings per request
    max_stop_chars: int = 1024            # characters of one stop string or one bad word
    max_bad_words: int = 128              # bad_words per request
    max_stop_token_ids: int = 1024        # stop_token_ids per request
    max_logit_bias: int = 1024            # logit_bias entries per request
    max_allowed_token_ids: int = 1 << 18  # allowed_token_ids per request
    max_structured_bytes: int = 48 * 1024  # structured_outputs as JSON (a schema, a grammar, a tag)
    max_tools: int = 128                  # OpenAI tools per request (OpenAI's own limit)
    max_tools_bytes: int = 32 * 1024      # OpenAI tools as JSON
    max_cache_salt_chars: int = 1024
    max_embedding_inputs: int = 2048      # inputs of one embedding request (OpenAI's own limit)
    # The model's context length, prompt characters and images per prompt (the
    # engine's limit_mm_per_prompt), where the front end knows them: max_tokens
    # and a prompt beyond them are refused before tokenising or decoding.
    max_model_len: Optional[int] = None
    max_prompt_chars: Optional[int] = None
    max_images: Optional[int] = None

    def __post_init__(self):
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"request limit {item.name} must be a positive integer, got {value!r}")

    def replace(self, **changes) -> "RequestLimits":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> "RequestLimits":
        """From ``{name: value}`` (text or numbers; names case-insensitive);
        an unknown name is refused, naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {}
        for name, value in values.items():
            if name.lower() not in known:
                raise ValueError(f"unknown request limit {name!r}; the limits are {', '.join(sorted(known))}")
            given[name.lower()] = coerce(f"request limit {name}", Optional[int], value)
        return cls(**given)

    def check(self, params: SamplingParams, fields: Mapping[str, Any]) -> None:
        """Every limit on the parameters (``fields``: the JSON object they came from)."""
        def refuse(name: str, message: str):
            raise InvalidRequestError(f"{name}: {message}", param=name)

        for name in ("seed", "priority", "top_k", "max_tokens", "min_tokens", "truncate_prompt_tokens"):
            value = getattr(params, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                refuse(name, f"{value} does not fit a 64-bit integer")
        counted = (("n", params.n, self.max_n, "outputs"), ("best_of", params.best_of, self.max_best_of, "candidates"),
                   ("stop", len(params.stop_list), self.max_stop_strings, "stop strings"),
                   ("bad_words", len(params.bad_words or ()), self.max_bad_words, "bad words"),
                   ("stop_token_ids", len(params.stop_token_ids), self.max_stop_token_ids, "stop token ids"),
                   ("logit_bias", len(params.logit_bias or ()), self.max_logit_bias, "entries"),
                   ("allowed_token_ids", len(params.allowed_token_ids or ()), self.max_allowed_token_ids,
                    "token ids"))
        for name, count, limit, what in counted:
            if count > limit:
                refuse(name, f"{count} {what}; the limit is {limit}")
        for name, texts in (("stop", params.stop_list), ("bad_words", params.bad_words or ())):
            longest = max((len(t) for t in texts), default=0)
            if longest > self.max_stop_chars:
                refuse(name, f"a string of {longest} characters; the limit is {self.max_stop_chars}")
        if params.cache_salt is not None and len(params.cache_salt) > self.max_cache_salt_chars:
            refuse("cache_salt", f"{len(params.cache_salt)} characters; the limit is {self.max_cache_salt_chars}")
        if self.max_model_len is not None and params.max_tokens is not None \
                and params.max_tokens > self.max_model_len:
            refuse("max_tokens", f"{params.max_tokens} is more than the model's context length "
                                 f"({self.max_model_len} tokens)")
        for name in ("structured_outputs", "guided_decoding"):
            if fields.get(name) is not None:
                size = len(json.dumps(fields[name]))
                if size > self.max_structured_bytes:
                    refuse(name, f"{size} bytes of JSON; the limit is {self.max_structured_bytes}")

    def check_prompt(self, prompt: Prompt) -> None:
        """A prompt longer than the context (token ids) or than max_prompt_chars
        (text), refused before anything tokenises or reads it."""
        if isinstance(prompt, str):
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise InvalidRequestError(f"prompt has {len(prompt)} characters; the limit is "
                                          f"{self.max_prompt_chars} (engine setting max_prompt_chars)",
                                          param="prompt")
        elif self.max_model_len is not None and len(prompt) > self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the maximum context length is "
                                      f"{self.max_model_len}", param="prompt")

    def check_tools(self, tools: Optional[list]) -> None:
        """OpenAI ``tools``: how many, and their size as JSON."""
        if not tools:
            return
        if len(tools) > self.max_tools:
            raise InvalidRequestError(f"tools: {len(tools)} tools; the limit is {self.max_tools}", param="tools")
        size = len(json.dumps(tools))
        if size > self.max_tools_bytes:
            raise InvalidRequestError(f"tools: {size} bytes of JSON; the limit is {self.max_tools_bytes}",
                                      param="tools")


@dataclass
class EngineRequest:
    """A request as the engine takes it, whichever front end it came by."""
    params: SamplingParams
    prompts: List[Prompt]                 # each a text or token ids (one per engine request)
    lora_name: Optional[str] = None       # the adapter it names (vllm_backend's field)
    fields: Dict[str, Any] = field(default_factory=dict)   # the JSON object the parameters came from
    # {"image": [...]}: the images as sent (base64, URLs) until decoded, then PIL images
    multi_modal_data: Optional[dict] = None
    pooling: Optional[dict] = None            # pooling (embedding) requests: none yet

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]

    def engine_prompt(self, index: int = 0):
        """Prompt ``index`` as the engine takes it: the text or token ids, or,
        with images, vLLM's ``{"prompt": text, "multi_modal_data": {...}}``."""
        if not self.multi_modal_data:
            return self.prompts[index]
        return {"prompt": self.prompts[index], "multi_modal_data": self.multi_modal_data}

    def wire(self) -> Dict[str, Any]:
        """The JSON object to send to the Triton model: the parameters and the adapter's name."""
        return {**self.fields, **({"lora_name": self.lora_name} if self.lora_name is not None else {})}


def map_request(fields: Mapping[str, Any], prompts: Sequence[Prompt] = (),
                limits: RequestLimits = RequestLimits(), images: Sequence = ()) -> EngineRequest:
    """The one mapping: vLLM-named sampling parameters (plus ``lora_name``),
    the prompts and the images sent with them (not yet decoded), checked, as
    an ``EngineRequest``. Raises ``InvalidRequestError`` naming the field."""
    if not isinstance(fields, Mapping):
        raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(fields).__name__}")
    fields = dict(fields)
    lora_name = fields.pop("lora_name", None)
    if lora_name is not None and not isinstance(lora_name, str):
        raise InvalidRequestError(f"lora_name must be a string, got {lora_name!r}", param="lora_name")
    for prompt in prompts:
        limits.check_prompt(prompt)
    try:
        params = SamplingParams.from_dict(fields)
    except InvalidRequestError as exc:   # its messages start with the field's name
        if exc.param is None:
            match = re.match(r"(?:sampling parameter )?([a-z_]+)\b", str(exc))
            exc.param = match.group(1) if match and match.group(1) in PARAMETER_NAMES else None
        raise
    limits.check(params, fields)
    if images:
        if limits.max_images is not None and len(images) > limits.max_images:
            raise InvalidRequestError(f"image: {len(images)} images; the limit is {limits.max_images} per prompt "
                                      "(limit_mm_per_prompt)", param="image")
        if any(not isinstance(p, str) for p in prompts):
            raise InvalidRequestError("image: images go with a text prompt; a prompt of token ids takes none "
                                      "(its image placeholders would have to be expanded already)", param="image")
    return EngineRequest(params, list(prompts), lora_name or None, fields,
                         {"image": list(images)} if images else None)


def model_context_length(folder) -> Optional[int]:
    """The most positions a Hugging Face model folder's config.json allows
    (its ``max_position_embeddings``, extended by RoPE scaling, of the text
    model too), or None when it says nothing: an upper bound of the engine's
    ``max_model_len``, for front ends that do not run the engine."""
    try:
        config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = []
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        limit = part.get("max_position_embeddings") or part.get("max_seq_len")
        if isinstance(limit, int) and limit > 0:
            found.append(limit)
            for rope in (part.get("rope_scaling"), part.get("rope_parameters")):
                if isinstance(rope, dict):
                    try:
                        found.append(rope_positions({**rope, "rope_type": rope.get("rope_type") or rope.get("type")},
                                                    limit))
                    except (TypeError, ValueError):
                        pass   # the engine refuses such a config, naming the field
    return max(found) if found else None


# ---------------------------------------------------------------- OpenAI

OPENAI_FORWARDED = ("temperature", "top_p", "seed", "top_k", "min_p", "min_tokens", "ignore_eos",
                    "stop_token_ids", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
                    "use_beam_search", "length_penalty", "early_stopping", "skip_special_tokens",
                    "include_stop_str_in_output", "best_of", "cache_salt", "priority")
# Sent only when they do something, so that clients which always send the
# neutral value (0 or 1) work with a model that lacks the parameter.
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def openai_fields(request, max_tokens: Optional[int], top_logprobs: Optional[int]) -> Dict[str, Any]:
    """An OpenAI completions or chat request (its parsed body) in vLLM's names."""
    params: Dict[str, Any] = {"n": request.n, "max_tokens": max_tokens}
    for name in OPENAI_FORWARDED:
        value = getattr(request, name)
        if value is not None:
            params[name] = value
    if request.stop is not None:   # "" and [""] alike reach SamplingParams, which refuses an empty stop
        params["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.logit_bias:  # token id (a string key in JSON) -> bias
        params["logit_bias"] = request.logit_bias
    for name, neutral in PENALTIES.items():
        value = getattr(request, name)
        if value is not None and value != neutral:
            params[name] = value
    if top_logprobs is not None:
        params["logprobs"] = top_logprobs
    return params


# ---------------------------------------------------------------- Triton

# Request parameters that Triton itself defines; the rest are sampling parameters.
TRITON_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout"}
# Request parameters of the generate endpoints may only be scalars (tritonserver
# refuses a list or an object itself), so these fields also come as JSON text.
JSON_TEXT_FIELDS = ("stop", "stop_token_ids", "logit_bias", "bad_words", "allowed_token_ids")


def triton_fields(text: Optional[str], parameters: Optional[str] = None) -> Dict[str, Any]:
    """The Triton model's sampling parameters: the ``sampling_parameters``
    tensor's JSON ``text`` when given, else the request's ``parameters`` (the
    generate endpoint's JSON, without Triton's own fields), parsed once."""
    if text is not None:
        if text_depth(text) > MAX_PARAMETERS_DEPTH:   # before the recursive decoder sees it
            raise InvalidRequestError(f"sampling_parameters nests deeper than {MAX_PARAMETERS_DEPTH} levels "
                                      "(a schema goes in structured_outputs.json, at most "
                                      f"{MAX_SCHEMA_DEPTH} levels deep)")
        try:
            return json.loads(text) if text.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
    text = parameters or "{}"
    if len(text) > MAX_PARAMETERS_BYTES:
        raise InvalidRequestError(f"request parameters have {len(text)} characters; "
                                  f"the limit is {MAX_PARAMETERS_BYTES}")
    try:
        values = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"request parameters are not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise InvalidRequestError(f"request parameters must be a JSON object, got {type(values).__name__}")
    return {k: _from_json_text(k, v) for k, v in values.items()
            if k not in TRITON_PARAMETERS and not k.startswith("triton_")}


def _from_json_text(name: str, value):
    """``value`` decoded from JSON text when ``name`` takes a list or an object
    (``"stop": "[\"a\", \"b\"]"``, ``"logit_bias": "{\"50\": -100}"``); a plain
    stop string, or text that is no such JSON, stays as it is."""
    if name not in JSON_TEXT_FIELDS or not isinstance(value, str) or value[:1] not in ("[", "{"):
        return value
    try:
        decoded = json.loads(value)
    except ValueError:
        return value
    if name == "stop" and not (isinstance(decoded, list) and all(isinstance(s, str) for s in decoded)):
        return value
    return decoded


# ---------------------------------------------------------------- Dynamo

# Dynamo's vLLM worker hands the cache salt to vLLM with this tag, and Dynamo's
# KV-event reader takes the salt back from the tag in a block's extra keys, so
# salted blocks land in the router's namespace of that salt.
CACHE_SALT_TAG = "dynamo-cache-salt:"
# sampling_options that map one to one onto vLLM's sampling parameters.
DYNAMO_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
# What a Dynamo worker cannot honour, and why (a request setting one is refused).
DYNAMO_REFUSED = {
    "n": "n > 1 is not served through the fleet (one output per request)",
    "best_of": "best_of > 1 is not served through the fleet",
    "use_beam_search": "beam search is not served through the fleet",
    "prompt_logprobs": "prompt log-probabilities are not served through the fleet",
    "max_thinking_tokens": "a thinking-token budget is not supported",
    "length_penalty": "length_penalty applies to beam search, which the fleet does not serve",
}
# Values of refused fields that ask for nothing (clients send them anyway).
DYNAMO_HARMLESS = {"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0}
# Fields read elsewhere or handled by Dynamo's frontend (stop strings, detokenising).
DYNAMO_HANDLED = {"stop", "include_stop_str_in_output", "skip_special_tokens", "formatted_prompt",
                  "return_tokens_as_token_ids", "guided_decoding", "logprobs", "max_tokens", "min_tokens",
                  "ignore_eos", "stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"}


def _dynamo_refuse_unknown(group: str, values: Dict[str, Any]) -> None:
    for name, value in values.items():
        if value is None or name in DYNAMO_HANDLED or name in DYNAMO_SAME_NAME:
            continue
        if name in DYNAMO_REFUSED:
            if name not in DYNAMO_HARMLESS or value != DYNAMO_HARMLESS[name]:
                raise InvalidRequestError(f"{group}.{name}: {DYNAMO_REFUSED[name]}", param=name)
        elif value not in (False, [], {}):
            raise InvalidRequestError(f"{group}.{name} is not supported by this worker", param=name)


def dynamo_cache_salt(request: Dict[str, Any]) -> Optional[str]:
    """The request's cache salt (``nvext.cache_salt`` or the top-level field)."""
    extra = request.get("extra_args") or {}
    for source in (request.get("nvext"), extra.get("nvext") if isinstance(extra, dict) else None,
                   request.get("routing")):
        if isinstance(source, dict) and source.get("cache_salt"):
            return str(source["cache_salt"])
    return None


def dynamo_fields(request: Dict[str, Any], context_length: int) -> Tuple[List[int], Dict[str, Any]]:
    """A Dynamo token request's prompt (token ids) and its options in vLLM's
    names; what a worker cannot honour is refused by name."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise InvalidRequestError("token_ids: a non-empty list of token ids is required", param="token_ids")
    groups = {}
    for group in ("sampling_options", "stop_conditions", "output_options"):
        groups[group] = request.get(group) or {}
        if not isinstance(groups[group], dict):
            raise InvalidRequestError(f"{group} must be an object", param=group)
        _dynamo_refuse_unknown(group, groups[group])
    sampling, stop, output = groups["sampling_options"], groups["stop_conditions"], groups["output_options"]
    params: Dict[str, Any] = {n: sampling[n] for n in DYNAMO_SAME_NAME if sampling.get(n) is not None}
    max_tokens = stop.get("max_tokens")
    params["max_tokens"] = max(1, context_length - len(token_ids)) if max_tokens is None else max_tokens
    for name in ("min_tokens", "ignore_eos"):
        if stop.get(name) is not None:
            params[name] = stop[name]
    stop_ids = set()
    for name in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        ids = stop.get(name) or []
        if not isinstance(ids, list):
            raise InvalidRequestError(f"stop_conditions.{name} must be a list of token ids", param=name)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise InvalidRequestError(f"stop_conditions.{name} must be a list of token ids", param=name)
        stop_ids.update(ids)
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    if output.get("logprobs") is not None:
        params["logprobs"] = output["logprobs"]
    guided = sampling.get("guided_decoding")
    if guided:
        if not isinstance(guided, dict):
            raise InvalidRequestError("sampling_options.guided_decoding must be an object", param="guided_decoding")
        params["guided_decoding"] = {k: v for k, v in guided.items() if v is not None}
    salt = dynamo_cache_salt(request)
    if salt:
        params["cache_salt"] = CACHE_SALT_TAG + salt
    return token_ids, params
