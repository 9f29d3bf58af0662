"""Grammars for structured outputs, compiled by xgrammar (the sampler applies
their token masks: ``sample/token_mask.py``).

A request's constraint is checked for shape and size where the request is
taken (``structured/params.py``); it is parsed into an xgrammar ``Grammar``
(where a bad schema, pattern or grammar is refused, with the library's
message) and compiled against the tokenizer's vocabulary on a thread of its
own, so the thread that takes requests only queues it. Compiled grammars are
cached by the constraint's text, up to a number of bytes; requests that ask for
a grammar while it compiles share that one compile. A request whose grammar is
still compiling is held by the engine, not the scheduler, so nothing else
waits for it.

Each sequence of a constrained request owns a ``GrammarState``
(``grammar_worker.py``): its matcher advances and fills the next mask on a
worker thread, and the sampler copies that mask into the row's bitmask and
masks the logits. Parallel samples fork the matcher with the sequence.
Preemption keeps a sequence's tokens, so its matcher stays valid through a
recompute or a swap.

xgrammar over llguidance (both measured on the default model's tokenizer,
``python -m loadtest.bench structured``): comparable mask times, a CPU
bitmask kernel, EBNF and structural tags natively, matcher fork and rollback.
"""
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Optional, Sequence

from ..errors import InvalidRequestError
from .params import StructuredOutputsParams
from .grammar_worker import FixedMask

__all__ = ["Compile", "FixedMask", "GrammarCompiler", "parse"]

CACHE_BYTES = 128 * 1024 * 1024        # compiled grammars kept (EngineConfig.structured_cache_bytes)
# A compiled grammar larger than this is refused (a 150-property schema: 1.3 MB).
MAX_COMPILED_BYTES = 32 * 1024 * 1024
_LOCATION = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")   # xgrammar's "[time] file.cc:line: "


def _library_message(exc: Exception) -> str:
    return _LOCATION.sub("", str(exc)).strip() or type(exc).__name__


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def parse(spec: StructuredOutputsParams):
    """The constraint as an xgrammar ``Grammar``, or InvalidRequestError
    naming the parameter and the library's message."""
    import xgrammar as xgr
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.json),
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}',
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        tag = json.loads(spec.structural_tag)
        if isinstance(tag, dict) and "structures" in tag:   # vLLM's first form: begin, schema, end
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
        return xgr.Grammar.from_structural_tag(spec.structural_tag)
    except Exception as exc:   # the library's parse errors are RuntimeError, ValueError and its own
        raise InvalidRequestError(f"structured_outputs.{kind}: {_library_message(exc)}") from None


def describe(spec: StructuredOutputsParams, limit: int = 80) -> str:
    """The constraint in a few words for an error message: its kind and the
    start of its text."""
    value = getattr(spec, spec.kind)
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{spec.kind} {text[:limit]!r}" + (" ..." if len(text) > limit else "")


class GrammarCompiler:
    """Parses and compiles constraints for one tokenizer and vocabulary, one
    at a time on a thread of its own, keeping compiled grammars up to
    ``cache_bytes`` (least recently used dropped). xgrammar's own compile
    cache, which keeps rules shared between grammars, holds at most a quarter
    of that (left unbounded, it grew without limit with distinct schemas)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_bytes: int = CACHE_BYTES):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: "OrderedDict[str, Future]" = OrderedDict()
        self._sizes: Dict[str, int] = {}   # key -> bytes, for compiled entries
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0              # held by the compiled entries now
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedbackend-grammar")
        self.compiles = 0              # grammars compiled (cache misses)

    def submit(self, spec: StructuredOutputsParams) -> "Compile":
        """Queue ``spec``'s parse and compile (or find it cached); returns its
        compile, whose error is the library's refusal if it has one."""
        key, label = spec.key(), describe(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return Compile(future, None, label)
            future = Future()
            self._cache[key] = future
        timing = Compile(future, 0.0, label)
        self._pool.submit(self._compile, spec, key, future, timing)
        return timing

    def _compile(self, spec: StructuredOutputsParams, key: str, future: Future, timing: "Compile") -> None:
        start = time.perf_counter()
        try:
            compiled = self._xgr_compiler().compile_grammar(parse(spec))
            size = compiled.memory_size_bytes
            if size > MAX_COMPILED_BYTES:
                raise InvalidRequestError(
                    f"structured_outputs.{spec.kind}: the compiled grammar takes {size / 2**20:.1f} MB; the "
                    f"limit is {MAX_COMPILED_BYTES / 2**20:.0f} MB (docs/structured_outputs.md)")
        except Exception as exc:
            with self._lock:
                self._cache.pop(key, None)   # a failure is not cached
            if not isinstance(exc, InvalidRequestError):
                exc = InvalidRequestError(
                    f"structured_outputs: the grammar could not be compiled: {_library_message(exc)}")
            future.set_exception(exc)
            return
        timing.seconds = time.perf_counter() - start
        self.compiles += 1
        self._keep(key, size + len(key))
        future.set_result(compiled)

    def _keep(self, key: str, size: int) -> None:
        """Count a compiled entry and drop the least recently used ones past the budget."""
        with self._lock:
            if key not in self._cache:
                return
            self._sizes[key] = size
            self.cached_bytes += size
            for old in list(self._cache):
                if self.cached_bytes <= self.cache_bytes:
                    break
                if old in self._sizes:
                    del self._cache[old]
                    self.cached_bytes -= self._sizes.pop(old)

    def _xgr_compiler(self):
        if self._compiler is None:   # only ever on the compile thread
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                 cache_limit_bytes=max(1, self.cache_bytes // 4))
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Compile:
    """One request's view of a grammar compile: the shared future, how long
    the compile took when this request started it (None for a cache hit), and
    the constraint in a few words (``label``)."""

    def __init__(self, future: Future, seconds: Optional[float], label: str = ""):
        self.future, self.seconds, self.label = future, seconds, label

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float) -> None:
        try:
            self.future.exception(timeout)
        except Exception:   # a timeout or a cancelled compile: the caller looks again
            pass

    def error(self) -> Optional[BaseException]:
        """The compile's error, once done (the library's refusal); None if it compiled."""
        return self.future.exception()

    def matcher(self):
        """A fresh matcher of the compiled grammar; raises the compile's error."""
        import xgrammar as xgr
        return xgr.GrammarMatcher(self.future.result())
