"""Shared test setup."""
import os
import pathlib

import torch

# Triton-lang kernels run on CPU tensors through the interpreter when no GPU is
# present; it must be switched on before `triton` is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The files that take longest (``make test PYTEST_ARGS=--durations=250`` on 2
# cores, summed per file, longest first) go to the workers first, so that the run
# does not end with one worker alone on one of them (``make test`` passes
# ``--no-loadscope-reorder`` so that pytest-xdist keeps this order).
SLOW_FILES_FIRST = (
    "engine/test_speculative.py", "serving/test_server_lifecycle.py", "tools/test_bench.py",
    "worker/test_model_runner.py", "serving/test_openai_server.py", "engine/test_structured_outputs.py",
    "worker/test_step_package.py", "serving/test_lora_server.py", "serving/test_stop_routes.py",
    "kernels/test_packed_linear.py", "models/test_moe_models.py", "serving/test_openai_structured_server.py",
    "worker/test_tensor_parallel.py", "tools/test_loadtest.py", "serving/test_fleet.py", "models/test_quant.py",
    "serving/test_embeddings_server.py", "engine/test_kv_cache_dtype_engine.py", "models/test_gguf.py",
    "serving/test_scores_server.py", "serving/test_fuzz_smoke.py", "serving/test_several_models.py")
_TESTS = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}

    def file_rank(item):
        try:
            return rank.get(item.path.relative_to(_TESTS).as_posix(), len(rank))
        except ValueError:
            return len(rank)
    items.sort(key=file_rank)   # stable: the order within a file is kept


# ---- model folders for the model runner tests -------------------------------
import pytest  # noqa: E402

# Everything is local: never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_dir():
    """The prepared SmolLM2-135M-Instruct folder (built once per cache)."""
    from pagedbackend.models.default_model import resolve_model_path
    return resolve_model_path("default")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """Tiny random Llama (4 layers, hidden 256, 4 heads / 2 KV heads), tied embeddings."""
    from tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory, default_model_dir):
    """The same shape with a separate LM head and 6 heads / 2 KV heads (GQA ratio 3)."""
    from tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_untied"), seed=1,
                            tie_word_embeddings=False, hidden_size=384,
                            num_attention_heads=6, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory, default_model_dir):
    """``tiny_vision(case)``: the folder of a tiny random vision-language
    checkpoint with its processor (``loadtest.tiny_vision.CASES``), saved once per session."""
    from loadtest.tiny_vision import build_tiny_vision
    folders = {}

    def folder(case):
        if case not in folders:
            folders[case] = build_tiny_vision(tmp_path_factory.mktemp(f"vision_{case}"), case)
        return folders[case]
    return folder


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, default_model_dir):
    """``tiny_family(case)``: the folder of a tiny random checkpoint of a
    model family (``loadtest.tiny_families.CASES``), saved once per session."""
    from loadtest.tiny_families import build_tiny_family
    folders = {}

    def folder(case):
        if case not in folders:
            folders[case] = build_tiny_family(tmp_path_factory.mktemp(f"tiny_{case}"), case)
        return folders[case]
    return folder
