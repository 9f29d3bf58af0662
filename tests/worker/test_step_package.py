"""The compiled step from an AOTInductor package (worker/step_package.py):
a runner without one serves eager steps while a lowest-priority process
builds it, then serves it with Hugging Face's greedy tokens; a restart
serves it from its first step; the key follows what the generated code
depends on; a damaged package is set aside, not trusted."""
import os
import pathlib
import time

import pytest
import torch

from pagedbackend.config import EngineConfig
from pagedbackend.models.attention import step_context
from pagedbackend.worker import step_build, step_package
from pagedbackend.worker.batch import SeqEntry
from pagedbackend.worker.compiled import compile_unavailable
from pagedbackend.worker.model_runner import ModelRunner
from runner_reference import greedy_hf, greedy_paged, load_hf, random_prompts

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=f"no C++ compiler here: {compile_unavailable(torch.device('cpu'))}")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts = random_prompts([1, 9, 40], 49152, seed=3)
    return tiny_model_dir, prompts, greedy_hf(load_hf(tiny_model_dir), prompts)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of our own (the build process inherits it)."""
    monkeypatch.setenv("PAGEDBACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path / "cache"


def config(folder, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(folder), block_size=16, num_kv_blocks=64, device="cpu",
                                  attention_backend="sdpa", compile=True), **overrides})


def _niceness_of_builders() -> list:
    """The niceness (field 19 of /proc/PID/stat) of every package build this
    process started: builds of other test workers, which may run at another
    priority, are not ours to count."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or b"pagedbackend.worker.step_build" not in (proc / "cmdline").read_bytes():
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid():   # field 4: the parent
                found.append(int(fields[16]))
        except OSError:
            continue
    return found


def test_built_beside_eager_steps_at_low_priority_then_served_from_the_first_step_of_a_restart(reference, cache):
    folder, prompts, expected = reference
    runner = ModelRunner(config(folder), compile_in_background=True)
    assert runner.compiled is None and runner.compile_thread.is_alive()
    assert greedy_paged(runner, prompts[:1]) == expected[:1]   # eager, while the package builds
    niceness = []
    while runner.compile_thread.is_alive() and not niceness:
        niceness = _niceness_of_builders()
        time.sleep(0.2)
    assert runner.wait_for_compile(timeout=1800)
    assert isinstance(runner.compiled, step_package.PackagedStep)
    assert niceness and set(niceness) == {19}, niceness   # the lowest priority
    assert greedy_paged(runner, prompts) == expected
    [path] = (cache / "steps").glob("*.pt2")
    assert path == runner.compiled.path and path.name.startswith(f"{folder.name}-float32-none-")

    restarted = ModelRunner(config(folder), compile_in_background=True)
    assert isinstance(restarted.compiled, step_package.PackagedStep) and restarted.compile_thread is None
    assert greedy_paged(restarted, prompts) == expected
    # The package holds no weights of its own: the runner's tensors are what it reads.
    assert path.stat().st_size < sum(p.numel() * p.element_size() for p in restarted.model.parameters())


def test_the_key_follows_threads_dtype_and_the_model_and_not_the_kv_pool(reference, cache):
    folder, _, _ = reference
    base = ModelRunner(config(folder, compile=False))
    other_pool = ModelRunner(config(folder, compile=False, num_kv_blocks=32, block_size=32))
    bf16 = ModelRunner(config(folder, compile=False, dtype="bfloat16"))
    keys = [step_package.step_key(r) for r in (base, other_pool, bf16)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        keys.append(step_package.step_key(base))
    finally:
        torch.set_num_threads(threads)
    assert keys[0] == keys[1] and len(set(keys)) == 3


def test_a_damaged_package_is_set_aside_not_trusted(reference, cache):
    folder, _, _ = reference
    runner = ModelRunner(config(folder, compile=False))
    path = step_package.package_path(runner)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    assert step_package.load(runner) is None   # the runner then compiles (or builds) as without one
    assert not path.exists() and path.with_suffix(".pt2.bad").read_bytes() == b"not a package"


def test_an_engine_that_compiles_before_its_first_step_builds_its_package_and_serves_it(reference, cache):
    folder, prompts, expected = reference
    runner = ModelRunner(config(folder))   # compile in the foreground, as LLM(...) does
    assert isinstance(runner.compiled, step_package.PackagedStep)
    assert runner.compiled.path == step_package.package_path(runner) and runner.compiled.path.is_file()
    assert greedy_paged(runner, prompts) == expected


def test_the_builder_holds_the_weights_once_its_buffers_registered_as_parameters(reference):
    """AOTInductor copies every buffer of the program it compiles (in case the
    graph writes it) and no parameter; the builder registers its model's
    buffers (the packed weights among them) as parameters on the same storage,
    so the program it exports lifts no buffer, and nothing is copied (a 1 B
    bfloat16 model: 1.9 GB less anonymous memory while it builds)."""
    folder, _, _ = reference
    runner = ModelRunner(config(folder, compile=False))
    before = {name: t.data_ptr() for name, t in runner.model.named_buffers()}
    assert before   # the packed weights are buffers
    assert step_build.buffers_as_parameters(runner.model) >= len(before)
    assert not dict(runner.model.named_buffers())
    params = dict(runner.model.named_parameters())
    assert all(params[name].data_ptr() == ptr and not params[name].requires_grad for name, ptr in before.items())
    batch = runner.prepare([SeqEntry([1, 2, 3], 0, [1])])
    with torch.inference_mode(), step_context(runner.kv_caches, batch.meta, runner.attention_ops):
        program = torch.export.export(step_build._Forward(runner.model).eval(), (batch.input_ids, batch.positions),
                                      strict=False)
    assert not program.graph_signature.inputs_to_buffers
    assert set(program.graph_signature.inputs_to_parameters.values()) >= {f"model.{name}" for name in before}
