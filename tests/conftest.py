"""Shared test setup."""
import os

import torch

# Triton-lang kernels run on CPU tensors through the interpreter when no GPU is
# present; it must be switched on before `triton` is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Under pytest-xdist each worker gets its share of the cores for torch's own
# threads: with more threads than cores, OpenMP threads wait on one another
# (two workers of two threads each on 2 cores took about a fifth longer, in
# CPU and in wall time, than two workers of one). Servers the tests start keep
# their own settings.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


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
