"""What a model family reads from a Hugging Face config.json: one dataclass
the shared layers build from (``ModelArgs``) and the helpers families parse
with. A field we do not serve is refused here, by name, before any weight
is read (``UnsupportedModelError``). Plain data: no torch."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class UnsupportedModelError(ValueError):
    """A checkpoint feature that is not served, named by its config field."""


def refuse(field: str, value, why: str) -> UnsupportedModelError:
    """The error for config field ``field`` holding ``value`` (raise it)."""
    return UnsupportedModelError(f"unsupported {field}={value!r}: {why}")


@dataclass
class ModelArgs:
    """The architecture fields the shared layers use; a family whose forward
    needs more subclasses it (``GraniteArgs``, ``GemmaArgs``, ...)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int          # the checkpoint's own limit (RoPE scaling reads it)
    tie_word_embeddings: bool
    ropes: List[dict]                     # the distinct RoPE settings (rotary.rope_parameters)
    layer_ropes: List[Optional[int]]      # per layer: its entry in ropes; None: no RoPE (NoPE)
    layer_windows: List[Optional[int]]    # per layer: sliding window (positions) or None: full
    attention_bias: bool = False          # q/k/v biases
    output_bias: bool = False             # o_proj bias
    mlp_bias: bool = False
    attention_scale: Optional[float] = None   # the softmax scale; None: head_dim ** -0.5
    vision_config: Optional[dict] = None      # a vision-language checkpoint's whole config (models.vision)
    num_labels: int = 0   # a *ForSequenceClassification decoder's score head (a reranker); 0: an LM head
    classifier_token_ids: Optional[List[int]] = None   # the score head from these LM head rows (no, yes)

    def __post_init__(self):
        for params in self.ropes:
            if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
                raise refuse("rope_parameters.rope_type", params["rope_type"],
                             f"supported RoPE types: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else float(self.attention_scale)

    @property
    def served_positions(self) -> int:
        """Positions a sequence may reach: the checkpoint's limit, extended by
        its RoPE scaling (``rope_positions``); sliding-window layers attend to
        their window at any length."""
        return max([self.max_position_embeddings,
                    *(rope_positions(params, self.max_position_embeddings) for params in self.ropes)])


def rope_positions(params: dict, max_position_embeddings: int) -> int:
    """The context a RoPE setting reaches, as vLLM derives it: YaRN's
    ``original_max_position_embeddings * factor`` and dynamic NTK's
    ``max_position_embeddings * factor``; for other types the checkpoint's
    ``max_position_embeddings`` already says it."""
    factor = params.get("factor") or 1.0
    if params.get("rope_type") == "yarn":
        return int(params.get("original_max_position_embeddings", max_position_embeddings) * factor)
    if params.get("rope_type") == "dynamic":
        return int(max_position_embeddings * factor)
    return max_position_embeddings


def required(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise UnsupportedModelError(f"config.json lacks {key}, which the {cfg.get('model_type')} forward needs")
    return cfg[key]


def common_fields(cfg: dict, tie_word_embeddings: bool, rms_norm_eps: float = 1e-6,
                  head_dim: Optional[int] = None) -> Dict[str, object]:
    """The fields every decoder reads, with the family's defaults for the
    ones its Hugging Face config class defaults (``head_dim``: None derives
    it from the hidden size)."""
    heads = required(cfg, "num_attention_heads")
    hidden = required(cfg, "hidden_size")
    head_dim = cfg.get("head_dim") or head_dim or hidden // heads
    return dict(vocab_size=required(cfg, "vocab_size"), hidden_size=hidden,
                intermediate_size=required(cfg, "intermediate_size"),
                num_layers=required(cfg, "num_hidden_layers"), num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=cfg.get("rms_norm_eps", rms_norm_eps),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=cfg.get("tie_word_embeddings", tie_word_embeddings))


def check_activation(cfg: dict, allowed: Sequence[str], *keys: str) -> str:
    """The MLP activation named by the first of ``keys`` present, refused
    unless ``allowed``."""
    for key in keys:
        if cfg.get(key) is not None:
            if cfg[key] not in allowed:
                raise refuse(key, cfg[key], f"served activations: {', '.join(allowed)}")
            return cfg[key]
    return allowed[0]


def layer_types_of(cfg: dict, default: Sequence[str]) -> List[str]:
    """``layer_types`` of the config (or ``default``), each a kind we serve."""
    types = list(cfg.get("layer_types") or default)
    if len(types) != cfg["num_hidden_layers"]:
        raise refuse("layer_types", len(types), f"needs one entry per layer ({cfg['num_hidden_layers']})")
    for kind in types:
        if kind not in LAYER_TYPES:
            raise refuse("layer_types", kind, f"served layer types: {', '.join(LAYER_TYPES)}")
    return types


def windows_of(layer_types: Sequence[str], window: Optional[int]) -> List[Optional[int]]:
    """Per layer: ``window`` for a sliding-attention layer, None for full attention."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise refuse("sliding_window", window, "needs a positive number of positions")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def distinct(settings: Sequence[Optional[dict]]):
    """``(unique settings, per-item index into them or None)``: one RoPE table per distinct setting."""
    unique: List[dict] = []
    index: List[Optional[int]] = []
    for item in settings:
        if item is None:
            index.append(None)
            continue
        if item not in unique:
            unique.append(item)
        index.append(unique.index(item))
    return unique, index
