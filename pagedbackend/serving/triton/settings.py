"""The Triton model's own settings, beside the engine's.

config.pbtxt ``parameters`` in upper case belong to the Triton model, not to
the engine (Triton's convention, and the names vllm_backend gives the same
switches, so its users' configs keep their meaning); ``engine_config`` skips
them. ``model.py`` reads them here once, in ``initialize``, before the engine
loads, so a bad value fails the load at once and names the parameter. Other
upper-case parameters (Triton's own, such as ``EXECUTION_ENV_PATH``) pass.
Lower-case parameters are ``EngineConfig`` fields.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from pagedbackend.config import coerce
from pagedbackend.serving.images import ImageLimits
from pagedbackend.serving.requests import RequestLimits

METRIC_NAMES = ("both", "pagedbackend", "vllm")
# vllm_backend's names for the same switches; when present, they win.
ALIASES = {"unload_on_engine_failure": ("ENABLE_VLLM_HEALTH_CHECK",)}


@dataclass(frozen=True)
class ModelSettings:
    """Each field is set by the parameter of its name in upper case."""
    # When the engine fails for good (every open request has its error): true
    # unloads the model, so Triton stops reporting it ready (needs
    # --model-control-mode=explicit, which python -m pagedbackend.serve sets);
    # false keeps it loaded, refusing every request until a restart (health.py).
    unload_on_engine_failure: bool = True
    # Custom metrics on /metrics at all (vllm_backend's name); false exports none.
    report_custom_metrics: bool = True
    # Which names the metrics carry: "both" (pagedbackend:* and vLLM's vllm:*),
    # "pagedbackend" or "vllm".
    metric_names: str = "both"
    # Threads that decode the images of requests (docs/images.md) and hand
    # them to the engine, whose image processor runs in add_request, off the
    # intake thread that reads every request.
    image_workers: int = 2
    # Requests with images that may wait for those threads; one more is
    # refused at once (UNAVAILABLE; 503 on the OpenAI API) rather than queued
    # without bound.
    image_queue: int = 16

    def __post_init__(self):
        if self.metric_names not in METRIC_NAMES:
            raise ValueError(f"parameter METRIC_NAMES must be one of {', '.join(METRIC_NAMES)}; "
                             f"got {self.metric_names!r}")
        if self.image_workers < 1 or self.image_queue < 0:
            raise ValueError(f"parameters IMAGE_WORKERS (at least 1) and IMAGE_QUEUE (at least 0): got "
                             f"{self.image_workers} and {self.image_queue}")

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> "ModelSettings":
        """From config.pbtxt ``parameters`` (strings or Triton's ``{"string_value": ...}``);
        an absent or empty parameter keeps the default."""
        values = {}
        for field in dataclasses.fields(cls):
            for name in parameter_names(field.name):   # the last one present wins
                text = _text(parameters.get(name))
                if text:
                    values[field.name] = coerce(f"parameter {name}", field.type, text)
        if "metric_names" in values:
            values["metric_names"] = values["metric_names"].lower()
        return cls(**values)

    @property
    def metric_namespaces(self) -> Tuple[str, ...]:
        """The metric namespaces to export (none when custom metrics are off)."""
        if not self.report_custom_metrics:
            return ()
        return METRIC_NAMES[1:] if self.metric_names == "both" else (self.metric_names,)


def request_limits(parameters: Mapping[str, Any], max_model_len: int, max_prompt_chars: int,
                   max_images: Optional[int] = None) -> RequestLimits:
    """The request limits (``RequestLimits``), each set by the parameter of its
    name in upper case (``MAX_N``, ``MAX_STOP_STRINGS``); the context length,
    prompt characters and images per prompt are the engine's."""
    engine_owned = ("max_model_len", "max_prompt_chars", "max_images")
    values = {f.name: _text(parameters.get(f.name.upper())) for f in dataclasses.fields(RequestLimits)
              if f.name not in engine_owned}
    limits = RequestLimits.from_settings({name: text for name, text in values.items() if text})
    return limits.replace(max_model_len=max_model_len, max_prompt_chars=max_prompt_chars, max_images=max_images)


def image_limits(parameters: Mapping[str, Any]) -> ImageLimits:
    """The image limits (``serving.images.ImageLimits``), each set by the
    parameter of its name in upper case (``MAX_IMAGE_PIXELS``,
    ``ALLOWED_MEDIA_DOMAINS``)."""
    values = {f.name: _text(parameters.get(f.name.upper())) for f in dataclasses.fields(ImageLimits)}
    return ImageLimits.from_settings({name: text for name, text in values.items() if text})


def parameter_names(field: str) -> Tuple[str, ...]:
    """The config.pbtxt parameters that set ``field``."""
    return (field.upper(), *ALIASES.get(field, ()))


def _text(value: Any) -> str:
    value = value.get("string_value", "") if isinstance(value, dict) else value
    return "" if value is None else str(value).strip()
