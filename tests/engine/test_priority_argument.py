"""vLLM's ``priority`` argument: ``LLM.generate(prompts, params, priority=[...])``
(one per prompt) and ``AsyncLLMEngine.add_request(..., priority=)`` order
admission under ``scheduling_policy=priority`` as the sampling parameter
does; a priority that is not an integer, or a list of the wrong length, is
refused. On the tiny random model, one sequence at a time."""
import pytest

from pagedbackend import LLM, InvalidRequestError, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine import AsyncLLMEngine

ONE = SamplingParams(max_tokens=2, temperature=0)
SETTINGS = dict(num_kv_blocks=64, compile=False, max_num_seqs=1, scheduling_policy="priority")


def scheduled_order(outputs) -> list:
    return [o.request_id for o in sorted(outputs, key=lambda o: o.metrics.first_scheduled_time)]


def test_llm_generate_takes_one_priority_per_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **SETTINGS)
    outputs = llm.generate(["five", "zero", "three"], ONE, priority=[5, 0, 3])
    names = {o.request_id: o.prompt for o in outputs}
    assert [names[r] for r in scheduled_order(outputs)] == ["zero", "three", "five"]
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        llm.generate(["a", "b", "c"], ONE, priority=[1, 2])
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        llm.generate(["a"], ONE, priority=[True])
    assert not llm.engine.check_idle()


def test_async_add_request_takes_a_priority(tiny_model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), **SETTINGS))
    try:
        blocker = engine.add_request("blocker", "Hold the only slot", SamplingParams(max_tokens=40, temperature=0,
                                                                                     ignore_eos=True))
        streams = [engine.add_request(name, name, ONE, priority=value)
                   for name, value in (("late", 9), ("first", -1), ("second", 4))]
        finals = [list(s)[-1] for s in [blocker, *streams]]
        assert all(f.finished and f.error is None for f in finals)
        assert scheduled_order(finals[1:]) == ["first", "second", "late"]
        with pytest.raises(InvalidRequestError, match="priority must be an integer"):
            engine.add_request("bad", "x", ONE, priority=1.5)
    finally:
        engine.shutdown()
