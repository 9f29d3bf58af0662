"""Property: whatever JSON a client sends as sampling parameters, and whatever
prompt, the engine either serves the request or refuses it with
InvalidRequestError before it is queued; nothing fails inside a step, no
block leaks, and a canary request is served afterwards.

`make test` runs a short profile; `make fuzz` runs 10,000 examples
(PAGEDBACKEND_FUZZ_EXAMPLES sets the count).
"""
import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedbackend import InvalidRequestError, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine
from pagedbackend.sampling_params import ACCEPTED_AT_DEFAULT, UNSUPPORTED

EXAMPLES = int(os.environ.get("PAGEDBACKEND_FUZZ_EXAMPLES", "60"))
STEPS = 4            # steps run per accepted request before it is aborted
NAMES = sorted({f for f in SamplingParams.__dataclass_fields__ if f != "stop_list"}
               | set(UNSUPPORTED) | set(ACCEPTED_AT_DEFAULT))

numbers = st.one_of(
    st.integers(min_value=-3, max_value=70),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.sampled_from([0, 1, 2, 20, 21, 49151, 49152, 10 ** 9, -1, 0.5, 1.0, 2.0]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12),
                    st.sampled_from(["1", "true", "nan", "-1", "1e309", "", " ", "\x00", "12"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4),
    st.dictionaries(st.sampled_from(["1", "12", "49151", "x", "-3"]), inner, max_size=3)), max_leaves=10)
payloads = st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=10)), json_values, max_size=6)
prompts = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.integers(min_value=0, max_value=49151), st.integers(), st.booleans(),
                       st.floats(), st.text(max_size=3)), max_size=40),
)
request_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=48, block_size=16,
                                  max_num_seqs=8, max_num_batched_tokens=256, compile=False))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(payload=payloads, prompt=prompts)
def test_any_request_is_served_or_refused_before_it_is_queued(engine, payload, prompt):
    request_id = f"fuzz-{next(request_ids)}"
    try:
        engine.add_request(request_id, prompt, SamplingParams.from_dict(payload))
    except InvalidRequestError as exc:
        assert str(exc)   # a message for the client
        assert not engine.has_unfinished_requests()
        return
    for _ in range(STEPS):   # any exception here would have killed a server's engine
        for out in engine.step():
            assert out.error is None
        if not engine.has_unfinished_requests():
            break
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_a_canary_is_served_after_the_fuzzing(engine):
    outs = []
    engine.add_request("canary", [100, 200, 300], SamplingParams(temperature=0.0, max_tokens=5,
                                                                 ignore_eos=True))
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].error is None
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert engine.block_manager.num_used_blocks == 0
