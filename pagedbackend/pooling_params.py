"""Pooling parameters, with vLLM's field names: what an embedding request asks
of the pooled hidden state.

Each field is checked when the object is built (``InvalidRequestError``
naming it); what depends on the model (``dimensions`` against the hidden
size) is checked by the engine when the request is submitted.
"""
import json
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from .errors import InvalidRequestError

# Poolers: the last token's hidden state (Qwen3-Embedding, e5-mistral), the
# mean over the prompt's tokens, the first token's (CLS).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """``dimensions``: keep the first ``dimensions`` components (Matryoshka
    embeddings), then normalise; ``normalize``: L2-normalise the result
    (None: the model's default, true unless its sentence-transformers files
    say otherwise); ``pooling_type``: LAST, MEAN or CLS (None: the model's)."""
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    pooling_type: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise InvalidRequestError(f"dimensions must be an integer, got {self.dimensions!r}")
            if self.dimensions < 1:
                raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}")
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise InvalidRequestError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                          f"got {self.pooling_type!r}")
            self.pooling_type = kind

    def check_dimensions(self, hidden_size: int) -> None:
        """Refuse ``dimensions`` larger than the model's embedding."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidRequestError(f"dimensions {self.dimensions} is larger than the model's "
                                      f"embedding size {hidden_size}")

    @classmethod
    def from_dict(cls, values: Optional[Dict[str, Any]]) -> "PoolingParams":
        """From a JSON object (a Triton request's ``pooling_params``); unknown keys are refused."""
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise InvalidRequestError(f"pooling_params must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"unknown pooling parameter(s) {', '.join(map(repr, unknown))}; "
                                      f"known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "PoolingParams":
        try:
            values = json.loads(text) if text.strip() else None
        except ValueError as exc:
            raise InvalidRequestError(f"pooling_params is not valid JSON: {exc}") from None
        return cls.from_dict(values)
