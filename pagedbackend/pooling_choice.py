"""What a model folder says about pooling: a sentence-transformers folder
(``modules.json`` naming a ``Pooling`` module, whose ``config.json`` picks the
pooler, and perhaps a ``Normalize`` module) is served as an embedding model
with that pooler, as vLLM's ``runner="auto"`` decides."""
import json
import pathlib
from dataclasses import dataclass
from typing import Optional, Tuple

# Encoders (models.bert): they serve embeddings and scores only, pooled from
# the first token (CLS) unless their folder says otherwise.
ENCODER_MODEL_TYPES = frozenset(("bert", "xlm-roberta"))

# sentence-transformers' pooling flags -> our pooler (the first set one wins).
_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_cls_token", "CLS"),
          ("pooling_mode_mean_tokens", "MEAN"))


@dataclass(frozen=True)
class PoolingDefaults:
    """A folder's pooler and whether its embeddings are L2-normalised."""
    pooling_type: str = "LAST"
    normalize: bool = True


def is_encoder_folder(model_path: pathlib.Path) -> bool:
    """Whether ``model_path``'s config.json names an encoder's model_type."""
    config_file = pathlib.Path(model_path) / "config.json"
    try:
        return json.loads(config_file.read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False   # the model check names what is wrong with the folder


def is_classifier_folder(model_path: pathlib.Path, overrides: Optional[dict] = None) -> bool:
    """Whether ``model_path``'s config.json (with ``overrides``) names a decoder
    ``*ForSequenceClassification`` (a reranker)."""
    try:
        config = {**json.loads((pathlib.Path(model_path) / "config.json").read_text()), **(overrides or {})}
        return (config.get("model_type") not in ENCODER_MODEL_TYPES and
                any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []))
    except (OSError, ValueError, AttributeError):
        return False


def resolve_runner(runner: str, pooling_type: Optional[str], model_path: pathlib.Path,
                   overrides: Optional[dict] = None) -> Tuple[str, str]:
    """``EngineConfig``'s ``runner`` and ``pooling_type`` made what the folder
    says where they are left to it ("auto", None): pooling for a
    sentence-transformers folder or an encoder, with its pooler (CLS for an
    encoder, LAST for a decoder, unless its files name one)."""
    pooling, encoder = read_pooling_defaults(model_path), is_encoder_folder(model_path)
    scores = encoder or is_classifier_folder(model_path, overrides)
    if scores and runner == "generate":
        raise ValueError(f"runner=generate: {model_path} is an encoder (BERT, XLM-RoBERTa) or a sequence "
                         "classifier, which serves embeddings and scores (runner=pooling)")
    if runner == "auto":
        runner = "pooling" if pooling is not None or scores else "generate"
    return runner, pooling_type or (pooling.pooling_type if pooling is not None else "CLS" if encoder else "LAST")


def read_pooling_defaults(model_path: pathlib.Path) -> Optional[PoolingDefaults]:
    """The sentence-transformers pooling of ``model_path``; None when it has
    no ``modules.json`` with a ``Pooling`` module. A pooling mode we do not
    serve (max, weighted mean) is refused, naming it."""
    modules_file = pathlib.Path(model_path) / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{modules_file} is not valid JSON: {exc}") from None
    kinds = {str(m.get("type", "")).rpartition(".")[2]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    pooling_file = pathlib.Path(model_path) / str(kinds["Pooling"].get("path", "1_Pooling")) / "config.json"
    config = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
    chosen = [kind for key, kind in _MODES if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in dict(_MODES))
    if others and not chosen:
        raise ValueError(f"{pooling_file}: pooling mode {', '.join(others)} is not served "
                         "(LAST, MEAN and CLS are)")
    return PoolingDefaults(chosen[0] if chosen else "MEAN", "Normalize" in kinds)
