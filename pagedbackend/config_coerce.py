"""Setting values as their fields' types: config.pbtxt strings, environment
variables and JSON request fields to bool, int or float."""
import typing
from typing import Any


def coerce(name: str, hint: Any, value: Any, error: type = ValueError) -> Any:
    """``value`` as the type ``hint`` names: strings (config.pbtxt values,
    environment variables, JSON request fields) become bool, int or float;
    other values pass through when they already have a fitting type. ``None``
    stays ``None``; anything else raises ``error`` naming ``name``."""
    if value is None:
        return None
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:   # Optional[X]
        hint = next(a for a in args if a is not type(None))
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
    if hint not in (bool, int, float):
        return value.strip() if hint is str and isinstance(value, str) else value
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            if hint is bool:
                if text in ("true", "1", "yes", "on"):
                    return True
                if text in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            return int(text) if hint is int else float(text)
        except ValueError:
            raise error(f"{name}: expected {hint.__name__}, got {value!r}") from None
    if hint is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
    elif isinstance(value, bool):
        pass
    elif hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    elif isinstance(value, (int, float)):
        return float(value) if hint is float else value
    raise error(f"{name}: expected {hint.__name__}, got {value!r}")
