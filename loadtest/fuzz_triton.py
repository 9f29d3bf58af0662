"""JSON bodies fuzzed against tritonserver's own HTTP routes of the served
model: ``generate``, ``generate_stream`` and ``infer`` (``loadtest.fuzz``,
docs/security.md).

hypothesis draws the bodies (wrong types, huge and non-finite numbers, deep
nesting, unknown fields, malformed ``sampling_parameters`` strings, wrong
tensor shapes and datatypes); they are then sent a few at a time. A case
fails on a 5xx other than 503 (the engine refusing while it is unhealthy or
stopping), on a dropped connection, or on a stream error event that reports
an internal error rather than a refusal.
"""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import httpx
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

from pagedbackend.serving.security import API_KEY_HEADER

MODEL = "paged_llm"
INPUTS = ("text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
          "return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
          "return_num_output_tokens", "return_num_cached_tokens", "return_prompt_logprobs", "return_output_ids",
          "lora_control")
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "seed", "stop",
            "stop_token_ids", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias", "bad_words", "use_beam_search",
            "length_penalty", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
            "lora_name", "cache_salt", "priority", "allowed_token_ids", "include_stop_str_in_output")
DATATYPES = ("BYTES", "BOOL", "INT64", "INT32", "INT8", "UINT32", "FP32", "FP16", "BF16", "FP64", "STRING", "")
# tritonserver 2.51's own 5xx, answered before the model sees the request
# (docs/security.md): infer's 501 for a decoupled model, and generate's 500
# for a body whose JSON does not convert to the model's inputs (a string for
# a BOOL input, a number beyond INT64, parameters that are no object of
# scalars, a body that is no object, a field name holding a NUL character,
# which Triton cuts short and then cannot find). Counted apart; any other 5xx fails.
TRITONSERVER_5XX = re.compile(
    r'^\{"error":"(HTTP end point doesn\'t support models with decoupled transaction policy"'
    r"|Unable to parse 'data': |Unable to parse JSON bytes array: attempt to access JSON "
    r"|attempt to get members for non-object|Expected JSON object for keyword: "
    r"|(Converting keyword: 'parameters': )?parameter key '.*' was not found in the JSON)")
# Markers of an internal error in a stream's error event (the model's INTERNAL
# replies, a request the engine failed, a traceback); refusals name the bad input.
INTERNAL_MARKERS = ("could not start the request", "failed while", "engine failed", "Traceback", "internal error")

numbers = st.one_of(
    st.integers(min_value=-3, max_value=200), st.integers(), st.integers(min_value=2 ** 62, max_value=2 ** 80),
    st.floats(allow_nan=False, allow_infinity=False), st.floats(min_value=-3, max_value=3),
    st.sampled_from([0, 1, -1, 16, 127, 128, 129, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30, 1e308, 0.5]))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=16),
                    st.sampled_from(["", "1", "true", "nan", "inf", "-1", "1e400", "\x00", "{", "[]"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` levels deep in lists (or objects), written by
    ``encode`` without recursion (``json.dumps`` stops at about 1000 levels)."""
    value: object
    depth: int
    objects: bool

    def text(self) -> str:
        opening, closing = ('{"a":', "}") if self.objects else ("[", "]")
        return opening * self.depth + encode(self.value) + closing * self.depth


def encode(value) -> str:
    """JSON text of a drawn value (``Deep`` parts included; NaN and the infinities as Python writes them)."""
    if isinstance(value, Deep):
        return value.text()
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def deep(leaf=json_values):
    """A value nested hundreds or thousands of levels deep."""
    return st.builds(Deep, leaf, st.integers(min_value=2, max_value=5000), st.booleans())


sampling_dicts = st.dictionaries(st.one_of(st.sampled_from(SAMPLING), st.text(max_size=8)),
                                 st.one_of(json_values, scalars), max_size=6)
sampling_strings = st.one_of(
    sampling_dicts.map(encode),
    st.text(max_size=60),
    st.sampled_from(["", "{", "null", "[]", "1", '{"max_tokens": NaN}', '{"max_tokens": 1e999}',
                     '{"n": 99999999999999999999999}', '{"stop": ' + '["a",' * 50 + '"a"' + ']' * 50 + '}',
                     '{"temperature": "hot"}', '{"max_tokens": 4, "max_tokens": -4}']),
    deep().map(encode))
prompts = st.one_of(st.text(max_size=40), st.sampled_from(["Hello", "The capital of France is"]))
field_values = st.one_of(json_values, prompts, sampling_strings, deep())
token_ids = st.lists(st.one_of(st.integers(min_value=0, max_value=300), numbers, scalars), max_size=20)


request_parameters = st.dictionaries(st.one_of(st.sampled_from(SAMPLING), st.text(max_size=8)),
                                     st.one_of(st.booleans(), numbers, st.text(max_size=12)), max_size=6)


@st.composite
def typed_bodies(draw):
    """A ``generate`` body whose fields have the JSON types of the model's
    inputs (a string prompt or integer ids, boolean flags, a string
    ``sampling_parameters`` or scalar request ``parameters``), their values
    fuzzed: these reach the model."""
    body = {}
    if draw(st.integers(0, 3)):
        body["text_input"] = draw(prompts)
    else:
        body["input_ids"] = draw(st.lists(st.one_of(st.integers(0, 300), st.integers(-2 ** 63, 2 ** 63 - 1)),
                                          max_size=20))
    if draw(st.booleans()):
        body["sampling_parameters"] = draw(sampling_strings)
    else:
        body["parameters"] = draw(request_parameters)
    flags = [name for name in INPUTS if name not in ("text_input", "input_ids", "sampling_parameters", "lora_control")]
    body.update(draw(st.dictionaries(st.sampled_from(flags), st.booleans(), max_size=4)))
    if not draw(st.integers(0, 9)):
        body["lora_control"] = draw(st.one_of(sampling_strings, st.sampled_from(['{"list": true}', '{"load": "x"}'])))
    return body


@st.composite
def untyped_bodies(draw):
    """A ``generate`` body with wrong types and unknown fields mixed in, or no object at all."""
    body = {}
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        body["text_input"] = draw(st.one_of(prompts, field_values))
    elif prompt == "ids":
        body["input_ids"] = draw(token_ids)
    if draw(st.booleans()):
        body["sampling_parameters"] = draw(st.one_of(sampling_strings, field_values))
    else:
        body["parameters"] = draw(st.one_of(sampling_dicts, field_values))
    body.update(draw(st.dictionaries(st.one_of(st.sampled_from(INPUTS), st.text(max_size=10)),
                                     st.one_of(st.booleans(), field_values), max_size=4)))
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), field_values))


def generate_bodies():
    """Bodies for ``generate``/``generate_stream`` (Triton maps top-level fields
    to the model's inputs and ``parameters`` to request parameters): two in
    three well typed."""
    return st.one_of(typed_bodies(), typed_bodies(), untyped_bodies())


tensors = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(INPUTS), st.text(max_size=10)),
     "shape": st.one_of(st.lists(st.one_of(st.integers(min_value=-2, max_value=4), numbers), max_size=4),
                        json_values),
     "datatype": st.one_of(st.sampled_from(DATATYPES), scalars),
     "data": st.one_of(token_ids, st.lists(prompts, max_size=3), st.lists(st.booleans(), max_size=3),
                       json_values, deep())},
    optional={"parameters": json_values})


@st.composite
def infer_bodies(draw):
    """A KServe v2 ``infer`` body: inputs with wrong shapes and datatypes."""
    body = {"inputs": draw(st.one_of(st.lists(tensors, max_size=5), field_values))}
    if draw(st.booleans()):
        body["parameters"] = draw(st.one_of(sampling_dicts, field_values))
    if draw(st.booleans()):
        body["outputs"] = draw(st.one_of(st.lists(st.fixed_dictionaries({"name": st.text(max_size=12)}),
                                                  max_size=3), field_values))
    if draw(st.booleans()):
        body["id"] = draw(scalars)
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), field_values))


def draw_bodies(count: int, seed: int) -> List[Tuple[str, object]]:
    """``count`` distinct (route, body) pairs, the same ones for the same seed."""
    routes = st.sampled_from(["generate", "generate_stream", "infer"]).flatmap(
        lambda route: st.tuples(st.just(route), infer_bodies() if route == "infer" else generate_bodies()))
    drawn = {}

    @hypothesis_seed(seed)
    @settings(max_examples=2 * count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(routes)
    def collect(case):
        if len(drawn) < count:
            drawn.setdefault((case[0], encode(case[1])), case)

    collect()
    return list(drawn.values())


@dataclass
class TritonFuzz:
    cases: int = 0
    seconds: float = 0.0
    statuses: dict = field(default_factory=dict)
    tritonserver_5xx: int = 0   # TRITONSERVER_5XX answers
    failures: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"part": "triton", "cases": self.cases, "seconds": round(self.seconds, 1),
                "statuses": dict(sorted(self.statuses.items())), "tritonserver_5xx": self.tritonserver_5xx,
                "failures": len(self.failures) + len(self.problems)}


def send(client: httpx.Client, base_url: str, route: str, body, api_key: str) -> Tuple[Optional[int], str]:
    """(status, what went wrong or "" or "tritonserver"): the reply read to its end."""
    url = f"{base_url}/v2/models/{MODEL}/{route}"
    data = encode(body).encode()
    headers = {"Content-Type": "application/json", API_KEY_HEADER: api_key}
    try:
        with client.stream("POST", url, content=data, headers=headers) as reply:
            text = reply.read().decode("utf-8", errors="replace")
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    status = reply.status_code
    if status >= 500 and status != 503:
        return status, "tritonserver" if TRITONSERVER_5XX.match(text) else text[:300]
    if route == "generate_stream":
        for line in text.splitlines():
            if line.startswith("data:") and '"error"' in line and any(m in line for m in INTERNAL_MARKERS):
                return status, line[:300]
    return status, ""


def run_bodies(base_url: str, api_key: str, count: int, max_time: float, seed: int = 0,
               workers: int = 4, timeout_s: float = 120.0) -> TritonFuzz:
    """Draw ``count`` bodies and send them, ``workers`` at a time, stopping at ``max_time`` seconds."""
    result = TritonFuzz()
    started = time.monotonic()
    cases = draw_bodies(count, seed)
    deadline = started + max_time

    def one(case):
        if time.monotonic() > deadline:
            return None
        route, body = case
        return route, body, send(client, base_url, route, body, api_key)

    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(workers) as pool:
        for done in pool.map(one, cases):
            if done is None:
                continue
            route, body, (status, wrong) = done
            result.cases += 1
            result.statuses[str(status)] = result.statuses.get(str(status), 0) + 1
            if wrong == "tritonserver":
                result.tritonserver_5xx += 1
            elif wrong:
                result.failures.append(f"{route} -> {status}: {wrong}\n  body: {encode(body)[:500]}")
    result.seconds = time.monotonic() - started
    if result.cases < count:
        result.problems.append(f"only {result.cases} of {count} bodies within {max_time:.0f} s")
    return result
