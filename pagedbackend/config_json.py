"""Settings given as JSON objects (``speculative_config``, ``kv_events_config``):
read from a dict or its JSON text, unknown fields refused by name."""
import dataclasses
import json
from typing import Any, Optional


def config_fields(cls, name: str, value: Any) -> Optional[Any]:
    """``value`` as a dict of ``cls``'s fields; None for None or "" (off);
    an instance of ``cls`` as it is. ValueError names ``name`` otherwise."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value
