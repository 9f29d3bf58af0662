"""Both executors implement the executor contract (``worker.executor.Executor``)
member by member, and the engine runs through it alone."""
import pytest

from pagedbackend import SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine
from pagedbackend.worker.executor import Executor
from pagedbackend.worker.model_runner import ModelRunner
from pagedbackend.worker.tp_executor import TensorParallelExecutor


def contract_members():
    names = set(Executor.__annotations__)
    names |= {n for n, v in vars(Executor).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)


def test_the_contract_names_geometry_lora_compile_status_description_and_shutdown():
    assert {"kv_layout", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "lora", "compiled_step",
            "wait_for_compile", "describe", "cpu_contended", "shutdown", "execute_model", "copy_blocks",
            "swap_out", "swap_in"} <= set(contract_members())


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(EngineConfig(model=str(tiny_model_dir), block_size=16, num_kv_blocks=32, device="cpu",
                                    attention_backend="torch", compile=False))


def test_model_runner_implements_every_member(runner):
    assert isinstance(runner, Executor)
    missing = [name for name in contract_members() if not hasattr(runner, name)]
    assert missing == []
    assert runner.compiled_step is False and runner.wait_for_compile(0) is False
    assert runner.lora is None and runner.kv_layout.windows == [None]
    assert set(runner.describe()) == {"linear_backend", "native_ops", "attention_backend", "lora_kernel"}
    runner.shutdown()   # nothing to stop; the runner still serves


def test_tensor_parallel_executor_implements_every_member():
    """Checked on the class (an instance starts worker processes: test_tensor_parallel
    runs those); members set per instance would show up missing here."""
    missing = [name for name in contract_members() if not hasattr(TensorParallelExecutor, name)]
    assert missing == []
    assert TensorParallelExecutor.lora is None and TensorParallelExecutor.compiled_step is False


def test_the_engine_runs_through_the_contract(runner):
    engine = LLMEngine(runner.config, runner=runner)
    assert isinstance(engine.runner, Executor)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert len(done) == 1 and done[0].outputs[0].num_tokens == 4 and done[0].outputs[0].finish_reason == "length"
    description = engine.describe()
    assert description["attention_backend"] == type(runner.attention_ops).__name__
    assert description["num_kv_blocks"] == 32
    stats = engine.get_stats()
    assert stats.compiled_step is False and stats.cpu_contended in (True, False)
