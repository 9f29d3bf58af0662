"""vLLM's ``structured_outputs`` sampling parameter, and its older ``guided_*``
fields. The shape and the documented limits (docs/structured_outputs.md) are
checked here, cheaply and without recursion, on the thread that takes the
request; the schema, pattern or grammar itself is parsed by the grammar
library on the compile thread (``structured/compiler.py``)."""
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Union

import numpy as np

from ..errors import InvalidRequestError

# vLLM's constraint kinds: exactly one is set per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's older per-kind fields of sampling parameters, and what each became.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_json_object": "json_object",
                 "guided_decoding_backend": "backend", "guided_whitespace_pattern": "whitespace_pattern"}
STRUCTURED_BACKENDS = ("auto", "xgrammar")
# Limits checked before anything is parsed (docs/structured_outputs.md).
# xgrammar's JSON-schema parse time grows with the cube of the nesting: 8 ms
# at 64 levels of the schema document, 0.6 s at 300, 27 s at 1,200.
MAX_SCHEMA_DEPTH = 64          # nesting of a JSON schema document (objects and arrays)
# A structural tag wraps its schemas in a few levels of its own.
MAX_TAG_DEPTH = MAX_SCHEMA_DEPTH + 8
# Nested ( ) groups of an EBNF grammar or a regex.
MAX_GRAMMAR_NESTING = 32
MAX_CONSTRAINT_CHARS = 256 * 1024   # text of a schema, pattern, grammar or tag


@dataclass
class StructuredOutputsParams:
    """vLLM's ``structured_outputs``: the output is constrained to a JSON
    schema (``json``), any JSON object, a regular expression, one of a list of
    strings, an EBNF/GBNF grammar or an xgrammar structural tag. Checked here
    for shape; the schema, pattern or grammar itself is checked by the grammar
    library when the engine takes the request (``structured/compiler.py``)."""
    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, Dict[str, Any]]] = None
    disable_any_whitespace: bool = False   # JSON without optional whitespace
    # Accepted as vLLM takes them: xgrammar's strict mode already refuses
    # properties a schema does not name, and there is no other backend to fall back to.
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: Optional[str] = None
    backend: Optional[str] = None

    def __post_init__(self):
        def bad(msg):
            raise InvalidRequestError(f"structured_outputs.{msg}")
        if isinstance(self.json, str):
            _check_size("json", self.json)
            if text_depth(self.json) > MAX_SCHEMA_DEPTH:   # before the recursive decoder sees it
                _too_deep("json", MAX_SCHEMA_DEPTH)
            try:
                self.json = json.loads(self.json)
            except (json.JSONDecodeError, RecursionError) as exc:
                bad(f"json is not valid JSON: {exc}")
        if self.json is not None and not isinstance(self.json, dict):
            bad(f"json must be a JSON schema (an object), got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            bad(f"choice must be a non-empty list of strings, got {self.choice!r:.80}")
        if self.choice is not None:
            self.choice = list(self.choice)
            _check_size("choice", "".join(self.choice))
        if isinstance(self.structural_tag, dict):
            _check_depth("structural_tag", self.structural_tag, MAX_TAG_DEPTH)
            self.structural_tag = json.dumps(self.structural_tag)
        if self.structural_tag is not None and (not isinstance(self.structural_tag, str)
                                                or not self.structural_tag.strip()):
            bad(f"structural_tag must be a JSON object or its text, got {self.structural_tag!r:.80}")
        self._check_limits()
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties",
                     "disable_fallback"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                bad(f"{name} must be true or false, got {value!r}")
        kinds = self.kinds
        if not kinds:
            bad(f"kind: one of {', '.join(STRUCTURED_KINDS)} must be set")
        if len(kinds) > 1:
            bad(f"kind: only one constraint may be set, got {' and '.join(kinds)}")
        if self.whitespace_pattern is not None:
            bad("whitespace_pattern is not supported by the xgrammar backend; "
                "use disable_any_whitespace for JSON without optional whitespace")
        if self.backend is not None and self.backend not in STRUCTURED_BACKENDS:
            bad(f"backend {self.backend!r} is not available: this server constrains outputs with "
                f"xgrammar ({' or '.join(STRUCTURED_BACKENDS)})")

    def _check_limits(self) -> None:
        """Size and nesting limits, before the library parses anything."""
        if isinstance(self.json, dict):
            _check_depth("json", self.json, MAX_SCHEMA_DEPTH)
            _check_size("json", json.dumps(self.json))
        if isinstance(self.structural_tag, str):
            _check_size("structural_tag", self.structural_tag)
            if text_depth(self.structural_tag) > MAX_TAG_DEPTH:
                _too_deep("structural_tag", MAX_TAG_DEPTH)
        for name, nesting in (("grammar", ebnf_nesting), ("regex", regex_nesting)):
            value = getattr(self, name)
            if isinstance(value, str):
                _check_size(name, value)
                depth = nesting(value)
                if depth > MAX_GRAMMAR_NESTING:
                    raise InvalidRequestError(
                        f"structured_outputs.{name} nests {depth} groups deep; the limit is "
                        f"{MAX_GRAMMAR_NESTING} (docs/structured_outputs.md)")

    @property
    def kinds(self) -> List[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    def key(self) -> str:
        """The constraint as text: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)

    @classmethod
    def build(cls, value) -> "StructuredOutputsParams":
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"structured_outputs must be a JSON object, got {value!r:.80}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unknown field(s): {', '.join(map(str, unknown))}")
        return cls(**value)


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(f"structured_outputs.{name} has {len(text)} characters; the limit is "
                                  f"{MAX_CONSTRAINT_CHARS} (docs/structured_outputs.md)")


def _too_deep(name: str, limit: int) -> None:
    raise InvalidRequestError(f"structured_outputs.{name} nests deeper than {limit} levels, the limit "
                              f"(docs/structured_outputs.md)")


def _check_depth(name: str, value: Any, limit: int) -> None:
    if json_depth(value, limit) > limit:
        _too_deep(name, limit)


def json_depth(value: Any, stop: int = 1 << 30) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (a scalar:
    0), found without recursion; counting stops past ``stop``."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > stop:
                return deepest
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


# A JSON string literal (an unrolled loop; one that never ends takes the rest
# of the text, so the scan stays linear), and anything but a bracket.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def text_depth(text: str) -> int:
    """How deeply objects and arrays nest in JSON text, without decoding it
    (brackets inside strings do not count); at C speed (5 ms a megabyte)."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    return max(0, int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max()))


_EBNF_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|\[[^\]\\]*(?:\\.[^\]\\]*)*\]?|#[^\n]*|[()]')


def ebnf_nesting(grammar: str) -> int:
    """How deeply groups ``( )`` nest in an EBNF grammar (string literals,
    character classes and comments skipped)."""
    depth = deepest = 0
    for match in _EBNF_TOKENS.finditer(grammar):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
    return deepest


_REGEX_TOKENS = re.compile(r"\\.|\[[^\]\\]*(?:\\.[^\]\\]*)*\]?|[()]")


def regex_nesting(pattern: str) -> int:
    """How deeply groups nest in a regular expression (escapes and character
    classes skipped)."""
    depth = deepest = 0
    for match in _REGEX_TOKENS.finditer(pattern):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
    return deepest


def from_guided_fields(params: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM's older ``guided_*`` fields (and its ``guided_decoding`` object)
    as one ``structured_outputs`` object."""
    guided = {GUIDED_FIELDS[name]: params.pop(name) for name in list(params) if name in GUIDED_FIELDS}
    if "guided_decoding" in params:
        value = params.pop("guided_decoding")
        if not isinstance(value, dict):
            raise InvalidRequestError(f"guided_decoding must be a JSON object, got {value!r:.80}")
        guided.update(value)
    guided = {name: value for name, value in guided.items() if value is not None and value is not False}
    if not any(name in STRUCTURED_KINDS for name in guided):   # a backend named alone constrains nothing
        return params
    if "structured_outputs" in params:
        raise InvalidRequestError("sampling parameters: structured_outputs and the older guided_* fields "
                                  "must not both be set")
    params["structured_outputs"] = guided
    return params
