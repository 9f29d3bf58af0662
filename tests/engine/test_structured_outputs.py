"""Structured outputs on the default model (real weights): every completed
output of a JSON-schema constraint parses and validates against its schema,
regex outputs fullmatch, choice outputs are members; greedy and sampled, n = 1
and 3, and again with preemption forced by a small pool (recompute and swap),
where greedy outputs must not change. Malformed constraints are refused
before queuing, those the library cannot parse end as refusals, both naming
the parameter; a grammar that is still compiling holds back only its own
request."""
import json
import re
import threading

import jsonschema
import pytest

from pagedbackend import LLM, InvalidRequestError, SamplingParams
from pagedbackend.engine.llm import merge_delta

pytestmark = pytest.mark.slow

S = {"type": "string"}
INT = {"type": "integer"}


def obj(required=None, **properties):
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


SCHEMAS = [
    ("a person", obj(name={**S, "maxLength": 20}, age={**INT, "minimum": 0, "maximum": 120})),
    ("a point in the plane", obj(x={"type": "number"}, y={"type": "number"})),
    ("a colour", obj(color={"enum": ["red", "green", "blue"]})),
    ("tags for a blog post", obj(tags={"type": "array", "items": {**S, "maxLength": 10}, "minItems": 1,
                                       "maxItems": 3})),
    ("a user account", obj(user=obj(id={**INT, "minimum": 1},
                                    email={**S, "pattern": "^[a-z]+@[a-z]+\\.com$"}))),
    ("a status", obj(ok={"type": "boolean"}, count={**INT, "minimum": 0, "maximum": 9})),
    ("some lottery numbers", {"type": "array", "items": {**INT, "minimum": 0, "maximum": 99},
                              "minItems": 2, "maxItems": 4}),
    ("a flight code", {**S, "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
    ("the price of a book", obj(price={"type": "number", "minimum": 0, "maximum": 1000})),
    ("a difficulty level", obj(level={"enum": [1, 2, 3]})),
    ("a versioned package", obj(version={"const": "1.0"}, name={**S, "maxLength": 8})),
    ("an optional note", obj(note={"type": ["string", "null"], "maxLength": 10})),
    ("a setting", obj(value={"anyOf": [INT, {"type": "boolean"}]})),
    ("an order", obj(items={"type": "array", "maxItems": 2, "items": obj(
        sku={**S, "pattern": "^[A-Z0-9]{4}$"}, qty={**INT, "minimum": 1, "maximum": 5})})),
    ("a record", obj(required=["a"], a=INT, b={**S, "maxLength": 5})),
    ("a date", obj(date={**S, "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"})),
    ("an answer", obj(answer={"enum": ["yes", "no", "not sure"]})),
    ("a number from ten to twenty", {**INT, "minimum": 10, "maximum": 20}),
    ("a nested flag", obj(a=obj(b=obj(c={"type": "boolean"})))),
    ("working days", obj(days={"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1,
                               "maxItems": 3})),
    ("a city", {**obj(city={**S, "maxLength": 15}, country={**S, "maxLength": 15},
                      population={**INT, "minimum": 0}), "additionalProperties": False}),
    ("a temperature reading", obj(celsius={"type": "number", "minimum": -50, "maximum": 60},
                                  unit={"const": "C"})),
]
REGEXES = [("today's date", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"), ("a phone number", r"\+[0-9]{2} [0-9]{3} [0-9]{4}"),
           ("a yes or no answer", r"(yes|no)\.")]
CHOICES = [("Is the sky blue?", ["yes", "no"]), ("Pick a fruit.", ["apple", "banana", "cherry pie"])]
MAX_TOKENS = 96


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def cases():
    """(prompt, constraint, check of one output text) for every constraint."""
    for what, schema in SCHEMAS:
        yield (chat(f"Give {what} as JSON."), {"json": schema},
               lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
    for what, pattern in REGEXES:
        yield chat(f"Write {what}."), {"regex": pattern}, lambda text, p=pattern: _fullmatch(p, text)
    for question, options in CHOICES:
        yield chat(question), {"choice": options}, lambda text, o=options: _member(text, o)


def _fullmatch(pattern, text):
    assert re.fullmatch(pattern, text), (pattern, text)


def _member(text, options):
    assert text in options, (text, options)


def run(llm, selected, sampled=True):
    """Greedy n = 1 and (if ``sampled``) seeded n = 3 for each case; returns
    [(check, [(text, finish_reason)]), ...] in order, greedy first."""
    prompts, params, checks = [], [], []
    for prompt, constraint, check in selected:
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=constraint))
        checks.append(check)
        if sampled:
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, n=3,
                                         structured_outputs=constraint))
            checks.append(check)
    outputs = llm.generate(prompts, params)
    assert not llm.engine.check_idle()
    return [(check, [(c.text, c.finish_reason) for c in out.outputs]) for check, out in zip(checks, outputs)]


def check_all(results, at_least_complete):
    complete = total = 0
    for check, outs in results:
        for text, reason in outs:
            total += 1
            if reason == "stop":   # a length cut-off may end inside the structure, as vLLM's do
                complete += 1
                check(text)
    assert complete >= at_least_complete * total, f"only {complete} of {total} outputs completed"


@pytest.fixture(scope="module")
def llm():
    return LLM("default", num_kv_blocks=512, compile=False)


@pytest.fixture(scope="module")
def unpreempted(llm):
    return run(llm, list(cases()))


def test_every_completed_output_validates_greedy_and_sampled_n_1_and_3(unpreempted):
    assert len(SCHEMAS) >= 20
    assert len(unpreempted) == 2 * (len(SCHEMAS) + len(REGEXES) + len(CHOICES))
    assert all(len(outs) == 3 for _, outs in unpreempted[1::2])
    check_all(unpreempted, at_least_complete=0.75)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_grammar_and_greedy_outputs(unpreempted, mode):
    selected = list(cases())[::3]
    small = LLM("default", num_kv_blocks=40, swap_space_blocks=256, preemption_mode=mode, compile=False)
    try:
        results = run(small, selected)
        stats = small.engine.get_stats()
    finally:
        small.shutdown()
    assert stats.num_preemptions > 0
    check_all(results, at_least_complete=0.75)
    greedy_alone = [outs for _, outs in unpreempted[::2]][::3]
    assert [outs for _, outs in results[::2]] == greedy_alone


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"type": "object"}, "regex": "a"}, ["only one constraint", "json and regex"]),
    ({}, ["one of json, regex, choice"]),
    ({"choice": []}, ["choice must be a non-empty list"]),
    ({"json": "{not json"}, ["json is not valid JSON"]),
    ({"regex": "a", "backend": "outlines"}, ["backend 'outlines'", "xgrammar"]),
    ({"regex": "a", "whitespace_pattern": " "}, ["whitespace_pattern"]),
    ({"regex": "a", "colour": 1}, ["unknown field", "colour"]),
])
def test_a_malformed_constraint_is_refused_before_queuing_naming_it(llm, constraint, words):
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("bad", "Hello", SamplingParams(structured_outputs=constraint))
    assert all(word in str(refused.value) for word in words), str(refused.value)
    assert "bad" not in llm.engine.groups and not llm.engine.compiling
    assert not llm.engine.check_idle()


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"type": "objectx"}}, ["structured_outputs.json", "objectx"]),
    ({"regex": "a(b"}, ["structured_outputs.regex", "parenthesis"]),
    ({"grammar": 'root ::= "a" |'}, ["structured_outputs.grammar", "EBNF"]),
    ({"structural_tag": '{"type": "structural_tag"}'}, ["structured_outputs.structural_tag", "format"]),
])
def test_a_constraint_the_library_refuses_ends_as_refused_naming_it(llm, constraint, words):
    out = llm.generate(["Hello"], SamplingParams(structured_outputs=constraint))[0]   # parsed off the intake thread
    assert out.error and out.refused and all(word in out.error for word in words), out.error
    assert not llm.engine.check_idle()


@pytest.mark.parametrize("choice", [["T\U000b416e"], ["\U000b416e", "T\U000b416e"]], ids=["after-a-token", "at-once"])
def test_a_grammar_no_token_can_continue_ends_its_request_as_refused_and_nothing_else(llm, choice):
    # U+B416E starts with the UTF-8 byte F3, which no token of this vocabulary
    # begins with: the grammar reaches a position whose mask allows nothing.
    # Before, token 0 was sampled there and the request failed as an internal error.
    constrained, plain = llm.generate(["Hello", "Hello"], [
        SamplingParams(structured_outputs={"choice": choice}, max_tokens=8, temperature=0),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])

    assert constrained.error and constrained.refused, constrained.error
    assert "no token of the model's vocabulary continues the grammar" in constrained.error
    assert plain.error is None and len(plain.outputs[0].token_ids) == 4
    assert not llm.engine.check_idle()


@pytest.mark.parametrize("fields, words", [
    ({"use_beam_search": True, "best_of": 2, "temperature": 0}, ["beam search", "structured_outputs"]),
    ({"ignore_eos": True}, ["ignore_eos", "structured_outputs"]),
])
def test_constraints_refuse_what_they_cannot_combine_with_by_name(fields, words):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(structured_outputs={"regex": "a+"}, **fields)
    assert all(word in str(refused.value) for word in words)


def test_vllm_older_guided_fields_become_structured_outputs():
    params = SamplingParams.from_dict({"guided_json": {"type": "object"}, "guided_decoding_backend": "xgrammar"})
    assert params.structured_outputs.json == {"type": "object"}
    assert params.structured_outputs.backend == "xgrammar"
    assert SamplingParams.from_dict({"guided_choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]
    assert SamplingParams.from_dict({"guided_decoding": {"regex": "x"}}).structured_outputs.regex == "x"
    assert SamplingParams.from_dict({"guided_decoding_backend": "xgrammar"}).structured_outputs is None
    with pytest.raises(InvalidRequestError, match="must not both be set"):
        SamplingParams.from_dict({"guided_regex": "a", "structured_outputs": {"regex": "b"}})


def test_a_length_cut_off_ends_with_length_inside_the_json(llm):
    schema = obj(text={**S, "minLength": 200})
    out = llm.generate([chat("Write a long text as JSON.")],
                       SamplingParams(max_tokens=8, temperature=0, structured_outputs={"json": schema}))[0]
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "length" and text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_min_tokens_gives_way_to_a_grammar_that_is_complete(llm):
    out = llm.generate([chat("Is the sky blue?")], SamplingParams(
        max_tokens=20, min_tokens=10, temperature=0, structured_outputs={"choice": ["yes", "no"]}))[0]
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_stop_strings_and_grammar_together(llm):
    out = llm.generate([chat("Write today's date.")], SamplingParams(
        max_tokens=20, temperature=0, stop=["-"], structured_outputs={"regex": r"20[0-9]{2}-[0-9]{2}"}))[0]
    assert re.fullmatch(r"20[0-9]{2}", out.outputs[0].text) and out.outputs[0].stop_reason == "-"


def test_a_grammar_no_token_can_satisfy_fails_its_request_alone(llm):
    yes = llm.get_tokenizer().encode("yes", add_special_tokens=False)
    params = [SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=yes,
                             structured_outputs={"choice": ["no"]}),
              SamplingParams(max_tokens=4, temperature=0, structured_outputs={"choice": ["no"]})]
    failed, fine = llm.generate([chat("Is the sky blue?")] * 2, params)
    assert failed.error and "no token satisfies the structured-output constraint" in failed.error
    assert fine.error is None and fine.outputs[0].text == "no"
    assert not llm.engine.check_idle()


def test_a_compiling_grammar_holds_back_only_its_own_request(llm):
    engine = llm.engine
    busy, release = threading.Event(), threading.Event()
    engine.grammars._pool.submit(lambda: (busy.set(), release.wait(60)))   # occupy the compile thread
    assert busy.wait(10)
    schema = obj(held={"enum": ["compiled", "later"]})   # not compiled before in this module
    engine.add_request("constrained", chat("Give a word as JSON."),
                       SamplingParams(max_tokens=16, temperature=0, structured_outputs={"json": schema}))
    engine.add_request("free", "The capital of France is", SamplingParams(max_tokens=6, temperature=0))
    merged, finished = {}, {}

    def step():
        for delta in engine.step():
            out = merge_delta(merged, delta)
            if out.finished:
                finished[out.request_id] = out
    try:
        while "free" not in finished:
            step()
        assert "constrained" not in finished
        assert [g.request_id for g in engine.compiling] == ["constrained"]
        assert engine.groups["constrained"].seqs[0].num_output_tokens == 0
    finally:
        release.set()
    while engine.has_unfinished_requests():
        step()
    jsonschema.validate(json.loads(finished["constrained"].outputs[0].text), schema)
    assert finished["constrained"].metrics.grammar_compile_time > 0
    assert not engine.check_idle()


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind(llm):
    engine = llm.engine
    release = threading.Event()
    engine.grammars._pool.submit(lambda: release.wait(60))
    engine.add_request("gone", chat("x"), SamplingParams(structured_outputs={"regex": "[a-z]{3}q"}))
    assert engine.compiling
    out = engine.abort_request("gone")
    release.set()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.compiling and not engine.check_idle()


def test_the_same_constraint_compiles_once(llm):
    engine = llm.engine
    engine.grammars._pool.submit(lambda: None).result(60)   # earlier tests' compiles are done (one thread)
    before = engine.grammars.compiles
    schema = obj(once={"enum": ["a", "b"]})
    llm.generate([chat("x")] * 3, SamplingParams(max_tokens=8, temperature=0, structured_outputs={"json": schema}))
    llm.generate([chat("y")], SamplingParams(max_tokens=8, temperature=0, structured_outputs={"json": schema}))
    assert engine.grammars.compiles == before + 1
    stats = engine.get_stats()
    assert stats.structured_requests >= 4 and stats.structured_mask_seconds > 0
