"""vLLM's ``structured_outputs`` sampling parameter, and its older ``guided_*``
fields. The shape is checked here; the schema, pattern or grammar itself is
checked by the grammar library when the engine takes the request
(``sample/structured.py``)."""
import json
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Union

from .errors import InvalidRequestError

# vLLM's constraint kinds: exactly one is set per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's older per-kind fields of sampling parameters, and what each became.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_json_object": "json_object",
                 "guided_decoding_backend": "backend", "guided_whitespace_pattern": "whitespace_pattern"}
STRUCTURED_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsParams:
    """vLLM's ``structured_outputs``: the output is constrained to a JSON
    schema (``json``), any JSON object, a regular expression, one of a list of
    strings, an EBNF/GBNF grammar or an xgrammar structural tag. Checked here
    for shape; the schema, pattern or grammar itself is checked by the grammar
    library when the engine takes the request (``sample/structured.py``)."""
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
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if self.structural_tag is not None and (not isinstance(self.structural_tag, str)
                                                or not self.structural_tag.strip()):
            bad(f"structural_tag must be a JSON object or its text, got {self.structural_tag!r:.80}")
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
