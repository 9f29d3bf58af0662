"""vLLM's ``speculative_config``: how drafts are proposed and how many tokens
each step verifies (``spec_decode/speculator.py``). A field of ``EngineConfig``."""
from dataclasses import dataclass
from typing import Any, Optional

from ..config_json import config_fields

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "self_int4")
DISABLE_BY_BATCH_SIZE = {"ngram": 8, "suffix": 8, "draft_model": 2, "self_int4": 2}


def _is_count(value: Any, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` (spec_decode/speculator.py says how tokens
    are verified and when proposals are turned down)."""
    # "ngram" (prompt lookup), "suffix" (suffix decoding: the request's own
    # text and its tenant's earlier answers), "draft_model" (``model``, a
    # Hugging Face folder sharing the target's tokenizer) or "self_int4" (the
    # target's own weights at quantization int4 as the draft: for the default
    # model, its GGUF's Q4_1 blocks; no second download).
    method: str
    # Tokens proposed per step and sequence, at most; None: 3, and for suffix
    # suffix_decoding_max_tree_depth (vLLM's rule).
    num_speculative_tokens: Optional[int] = None
    # ngram: the shortest suffix of the sequence looked up in it.
    prompt_lookup_min: int = 2
    # ngram: the longest suffix looked up (tried first).
    prompt_lookup_max: int = 4
    # suffix: the longest match looked for, in tokens.
    suffix_decoding_max_tree_depth: int = 24
    # suffix: earlier requests' outputs kept per tenant (cache_salt); 0: only
    # the request's own prompt and output. vLLM's default is 10000; an entry
    # costs up to ~200 bytes a token here, so fewer.
    suffix_decoding_max_cached_requests: int = 1000
    # suffix: a draft is at most this factor times the match's length.
    suffix_decoding_max_spec_factor: float = 1.0
    # suffix: a drafted token's estimated probability (the share of matches
    # that continue with it, times its predecessors') must reach this.
    suffix_decoding_min_token_prob: float = 0.1
    # suffix: tokens kept per tenant, at most (memory: up to ~200 B each).
    suffix_decoding_max_cached_tokens: int = 65_536
    # suffix: tenants holding an index of earlier outputs, at most; the least
    # recently used one's index is dropped first.
    suffix_decoding_max_tenants: int = 16
    # draft_model: the draft's folder ("default": the default model).
    model: Optional[str] = None
    # draft_model: the draft's quantization ("none", "int8", "int4", "w8a8").
    quantization: str = "none"
    # vLLM's name: no proposals in a step where more sequences decode; 0: never
    # off; None: the method's default (DISABLE_BY_BATCH_SIZE), from BENCHMARKS.md's
    # "specdecode": a draft model's rounds cost nearly a target step on a CPU,
    # so they pay only at one or two streams; n-gram lookups cost nothing.
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if self.num_speculative_tokens is None:
            depth = self.suffix_decoding_max_tree_depth
            self.num_speculative_tokens = depth if self.method == "suffix" and _is_count(depth) else 3
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_tenants"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("suffix_decoding_max_cached_requests", "suffix_decoding_max_cached_tokens"):
            if not _is_count(getattr(self, name), 0):
                raise ValueError(f"speculative_config.{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, float("inf")),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be a number in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft's folder) is needed for method draft_model")
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = DISABLE_BY_BATCH_SIZE[self.method]
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 0 (0: never off) "
                             f"or null (the method's default), got {self.disable_by_batch_size!r}")

    @classmethod
    def build(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """From a dict, its JSON text (config.pbtxt), an instance, or None / "" (off)."""
        value = config_fields(cls, "speculative_config", value)
        if value is None or isinstance(value, cls):
            return value
        if "method" not in value:
            raise ValueError("speculative_config.method is required")
        return cls(**value)
