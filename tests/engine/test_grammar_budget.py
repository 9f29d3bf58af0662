"""Grammar work cannot stall a step: a constrained request whose token mask
is late holds back only itself; a grammar whose masks grow past its per-token
or total budget ends alone with an error naming it (with and without n-gram
speculation); grammars over the nesting and size limits are refused at
admission, and those the library cannot parse end as refusals naming the
parameter; an abort takes effect at the next step however long its grammar's
work runs. On the tiny random model with the default model's tokenizer."""
import json
import threading

import pytest

from pagedbackend import LLM, InvalidRequestError, SamplingParams
from pagedbackend.engine.llm import merge_delta
from pagedbackend.structured.grammar_worker import WORKERS
from pagedbackend.structured.params import MAX_CONSTRAINT_CHARS, MAX_GRAMMAR_NESTING, MAX_SCHEMA_DEPTH


def nested(depth: int) -> str:
    """The grammar bomb: repetitions nested ``depth`` deep around one "a"
    (ambiguous, so its parser keeps more states after every token)."""
    return "root ::= " + "(" * depth + '"a"' + ")*" * depth


def deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_schema_text(levels: int) -> str:
    """The same schema as JSON text (too deep for json.dumps)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


FREE = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=128, compile=False,
               structured_mask_token_s=0.05, structured_mask_total_s=5.0)


def run_all(engine) -> dict:
    merged, finished = {}, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = merge_delta(merged, delta)
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("constraint, words", [
    ({"grammar": nested(500)}, ["grammar nests 500 groups deep", f"limit is {MAX_GRAMMAR_NESTING}"]),
    ({"regex": "(" * 40 + "a" + ")" * 40}, ["regex nests 40 groups deep"]),
    ({"json": deep_schema(600)}, ["json nests deeper than", str(MAX_SCHEMA_DEPTH)]),
    ({"json": deep_schema_text(600)}, ["json nests deeper than"]),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "json_schema",
                                                               "json_schema": deep_schema(600)}}},
     ["structural_tag nests deeper than"]),
    ({"grammar": 'root ::= "' + "a" * MAX_CONSTRAINT_CHARS + '"'}, ["grammar has", "characters"]),
])
def test_grammars_over_the_documented_limits_are_refused_at_admission(constraint, words):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(structured_outputs=constraint)
    assert all(w in str(refused.value) for w in words), str(refused.value)


def test_deep_sampling_parameters_are_refused_before_they_are_decoded():
    deep = '{"guided_json": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
    with pytest.raises(InvalidRequestError, match="sampling_parameters nests deeper than"):
        SamplingParams.from_json(deep)
    as_text = json.dumps({"max_tokens": 4, "guided_json": deep_schema_text(600)})   # a schema given as text
    with pytest.raises(InvalidRequestError, match="json nests deeper than"):
        SamplingParams.from_json(as_text)


def test_the_thread_that_takes_a_request_only_queues_its_grammar(llm):
    engine = llm.engine
    release = threading.Event()
    engine.grammars._pool.submit(release.wait, 60)   # the compile thread is busy
    try:
        group = engine.make_group("queued", "Hello", SamplingParams(structured_outputs={"json": {"type": "objectx"}}))
        assert not group.grammar.done()   # neither parsed nor refused yet: that happens on the compile thread
    finally:
        release.set()
    group.grammar.wait(30)
    assert "objectx" in str(group.grammar.error())


def test_nesting_counts_groups_not_brackets_inside_strings_or_classes():
    deep_text = 'root ::= "((((((((((((((((((((((((((((((((((((((((" [(((] ' + nested(3)[9:]
    params = SamplingParams(structured_outputs={"grammar": deep_text})
    assert params.structured_outputs.grammar == deep_text   # 3 groups: accepted


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"type": "objectx"}}, ["structured_outputs.json", "objectx"]),
    ({"regex": "a(b"}, ["structured_outputs.regex"]),
    ({"grammar": 'root ::= "a" |'}, ["structured_outputs.grammar", "EBNF"]),
])
def test_a_constraint_the_library_refuses_ends_its_request_as_refused_naming_it(llm, constraint, words):
    engine = llm.engine
    engine.add_request("bad", "Hello", SamplingParams(structured_outputs=constraint))   # parsed off this thread
    engine.add_request("free", "Hello", FREE)
    finished = run_all(engine)
    bad = finished["bad"]
    assert bad.error and bad.refused and all(w in bad.error for w in words), bad.error
    assert finished["free"].error is None and len(finished["free"].outputs[0].token_ids) == 8
    assert not engine.check_idle()


def test_a_constrained_request_whose_mask_is_late_holds_back_only_itself(llm):
    engine = llm.engine
    release = threading.Event()
    held = [engine.structured.workers.pool.submit(release.wait, 60) for _ in range(WORKERS)]   # every worker busy
    try:
        engine.add_request("late", "Answer:", SamplingParams(max_tokens=20, temperature=0,
                                                             structured_outputs={"choice": ["yes", "no"]}))
        engine.add_request("free", "Hello", FREE)
        merged, steps = {}, 0
        while not (merged.get("free") and merged["free"].finished):
            for delta in engine.step():
                merge_delta(merged, delta)
            steps += 1
        assert len(merged["free"].outputs[0].token_ids) == 8 and steps >= 8
        assert engine.groups["late"].seqs[0].num_output_tokens == 0   # scheduled, never sampled
    finally:
        release.set()
    assert all(h.result(10) for h in held)
    late = run_all(engine)["late"]
    assert late.error is None and late.outputs[0].text in ("yes", "no")
    assert not engine.check_idle()


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_min": 1, "disable_by_batch_size": 0}])
def test_a_grammar_whose_masks_grow_past_the_per_token_budget_ends_alone_naming_it(tiny_model_dir,
                                                                                     speculative_config):
    engine_settings = dict(num_kv_blocks=128, compile=False, structured_mask_token_s=0.05,
                           speculative_config=speculative_config)
    alone = LLM(str(tiny_model_dir), **engine_settings).generate(["Hello"], FREE)[0]
    llm = LLM(str(tiny_model_dir), **engine_settings)
    bomb, free = llm.generate(["Say a:", "Hello"], [
        SamplingParams(max_tokens=400, min_tokens=400, temperature=0, structured_outputs={"grammar": nested(20)}), FREE])
    assert bomb.error and "structured_mask_token_s" in bomb.error and "root ::= ((((" in bomb.error, bomb.error
    assert 0 < len(bomb.outputs[0].token_ids) < 400
    assert free.error is None and free.outputs[0].token_ids == alone.outputs[0].token_ids
    assert not llm.engine.check_idle()


def test_a_grammar_past_its_total_mask_budget_ends_alone_naming_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, compile=False, structured_mask_token_s=30,
              structured_mask_total_s=0.05)
    slow, free = llm.generate(["Say a:", "Hello"], [
        SamplingParams(max_tokens=400, min_tokens=400, temperature=0, structured_outputs={"grammar": nested(6)}), FREE])
    assert slow.error and "structured_mask_total_s" in slow.error and "root ::= ((((((" in slow.error
    assert free.error is None and len(free.outputs[0].token_ids) == 8
    assert not llm.engine.check_idle()


def test_an_abort_takes_effect_at_the_next_step_while_its_grammar_works(llm):
    engine = llm.engine
    release = threading.Event()
    held = [engine.structured.workers.pool.submit(release.wait, 60) for _ in range(WORKERS)]
    try:
        engine.add_request("stuck", "Say a:", SamplingParams(max_tokens=20, structured_outputs={"grammar": nested(3)}))
        engine.add_request("free", "Hello", SamplingParams(max_tokens=30, temperature=0))
        for _ in range(3):
            engine.step()
        state = engine.groups["stuck"].seqs[0].constraint
        assert not state.ready()
        out = engine.abort_request("stuck")
        assert out.finished and out.outputs[0].finish_reason == "abort"
        engine.step()
        assert "stuck" not in engine.groups and state.ready()   # its queued work was dropped
    finally:
        release.set()
    run_all(engine)
    assert not engine.check_idle()
