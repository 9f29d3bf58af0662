"""The grammar compile cache is bounded in bytes: compiling hundreds of
distinct schemas keeps our cache under its budget (least recently used
dropped, recompiled when asked again) and resident memory levels off
(xgrammar's own cache, unbounded, grew it without limit)."""
import pytest

from pagedbackend.engine.tokenizer import load_tokenizer
from pagedbackend.structured.compiler import GrammarCompiler
from pagedbackend.structured.params import StructuredOutputsParams

CACHE_BYTES = 4 * 1024 * 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def schema(i: int) -> StructuredOutputsParams:
    """A distinct small schema (xgrammar caches by structure, so names differ)."""
    return StructuredOutputsParams(json={"type": "object", "required": [f"k{i}_0"], "properties": {
        f"k{i}_{j}": {"type": ("string", "integer", "boolean")[j % 3]} for j in range(20)}})


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    compiler = GrammarCompiler(load_tokenizer(default_model_dir), 49152, [2], cache_bytes=CACHE_BYTES)
    yield compiler
    compiler.shutdown()


def compile_all(compiler, first: int, count: int) -> None:
    for i in range(first, first + count):
        compile_ = compiler.submit(schema(i))
        compile_.wait(60)
        assert compile_.error() is None


def test_resident_memory_levels_off_over_distinct_schemas(compiler):
    compile_all(compiler, 0, 60)   # both caches are full by now
    after_60 = rss_mb()
    compile_all(compiler, 60, 200)   # unbounded, they grew resident memory 50-60 MB more here
    after_260 = rss_mb()
    assert compiler.compiles == 260
    assert compiler.cached_bytes <= CACHE_BYTES
    assert after_260 - after_60 < 20, (after_60, after_260)


def test_the_least_recently_used_grammar_is_dropped_and_compiled_again(compiler):
    kept = compiler.submit(schema(1000))
    kept.wait(60)
    before = compiler.compiles
    compile_all(compiler, 2000, 60)   # more than the budget holds
    assert compiler.submit(schema(2059)).seconds is None   # the latest is still cached
    again = compiler.submit(schema(1000))
    again.wait(60)
    assert again.seconds is not None and compiler.compiles == before + 61
