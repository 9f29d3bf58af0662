"""The inductor cache's folder is named by a digest of torch's version and our
custom ops' schemas and source (worker/compiled.py), so a graph compiled
against one op signature is never loaded by a build with another (a graph of
a 6-argument paged_attention loaded by a 5-argument build fails)."""
import pathlib

import torch

from pagedbackend.models import attention
from pagedbackend.worker import compiled

SIX_ARGS = "pagedbackend::paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window) -> Tensor"
FIVE_ARGS = "pagedbackend::paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor"
SOURCES = [("attention.py", b"def paged_attention(): ..."), ("packed_ops.cpp", b"m.def(...);")]


def folder(schemas, sources=SOURCES, version="2.13.0+cpu") -> str:
    return compiled.compile_cache_folder(compiled.ops_digest(schemas, sources, version)).name


def test_the_folder_changes_with_an_op_schema_its_source_or_torch():
    base = folder([SIX_ARGS])
    assert base.startswith("inductor-") and base == folder([SIX_ARGS])
    assert folder([FIVE_ARGS]) != base
    assert folder([SIX_ARGS], [SOURCES[0], ("packed_ops.cpp", b"m.def(..., int rows);")]) != base
    assert folder([SIX_ARGS], version="2.14.0+cpu") != base
    assert folder([SIX_ARGS, "pagedbackend::packed_linear(Tensor x) -> Tensor"]) != base
    # The order in which ops or files are listed does not matter.
    assert folder([SIX_ARGS], list(reversed(SOURCES))) == base


def test_this_builds_digest_follows_the_registered_schema_and_the_op_modules_text(tmp_path, monkeypatch):
    schema = str(torch._C._jit_get_schemas_for_operator("pagedbackend::paged_attention")[0])
    assert "int window" in schema   # what the digest reads is the op as registered now
    before = compiled.custom_ops_digest()
    assert before == compiled.custom_ops_digest()
    edited = tmp_path / "attention.py"
    edited.write_bytes(pathlib.Path(attention.__file__).read_bytes() + b"\n# an edit\n")
    monkeypatch.setattr(attention, "__file__", str(edited))
    assert compiled.custom_ops_digest() != before


def test_inductor_is_pointed_at_the_digests_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBACKEND_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    expected = tmp_path / f"inductor-{compiled.custom_ops_digest()}"
    assert compiled.use_compile_cache() == str(expected)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    assert cache_dir() == str(expected)   # what inductor itself now uses
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.use_compile_cache() == str(tmp_path / "mine")
