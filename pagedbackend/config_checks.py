"""EngineConfig's checks of a feature's settings together (adapters,
images, the disk KV tier), kept beside the dataclass whose fields they read."""
import json
import os
import pathlib

from .config_coerce import coerce


def check_lora(config) -> None:
    """The adapter settings (``enable_lora``, pool sizes) and what they rule out."""
    if isinstance(config.enable_lora, str):   # vllm_backend's model.json gives "true" or true
        config.enable_lora = coerce("enable_lora", bool, config.enable_lora)
    if not isinstance(config.enable_lora, bool):
        raise ValueError(f"enable_lora must be true or false, got {config.enable_lora!r}")
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if config.max_cpu_loras is not None and (isinstance(config.max_cpu_loras, bool) or not isinstance(
            config.max_cpu_loras, int) or config.max_cpu_loras < config.max_loras):
        raise ValueError(f"max_cpu_loras ({config.max_cpu_loras!r}) must be an integer >= max_loras "
                         f"({config.max_loras}), or None")
    if not config.enable_lora:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError("enable_lora does not support tensor_parallel_size > 1: adapters are served "
                         "on one rank; use tensor_parallel_size=1")
    if config.quantization == "w8a8":
        raise ValueError("enable_lora does not combine with quantization=w8a8 (its smoothing rescales the "
                         "projections' inputs that LoRA reads); use none, int8 or int4")


def check_multimodal(config) -> None:
    """``hf_overrides`` and the image settings (JSON text read as a dict)."""
    if isinstance(config.hf_overrides, str):
        try:
            config.hf_overrides = json.loads(config.hf_overrides)
        except ValueError as exc:
            raise ValueError(f"hf_overrides must be a JSON object: {exc}") from None
    if config.hf_overrides is not None and not isinstance(config.hf_overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json fields, got {config.hf_overrides!r}")
    limits = config.limit_mm_per_prompt
    if isinstance(limits, str):
        try:
            limits = json.loads(limits)
        except ValueError as exc:
            raise ValueError(f"limit_mm_per_prompt must be JSON like {{\"image\": 2}}: {exc}") from None
    if limits is not None and not (isinstance(limits, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values())):
        raise ValueError(f"limit_mm_per_prompt must map modalities to counts >= 0, got {limits!r}")
    config.limit_mm_per_prompt = limits
    if config.max_num_encoder_input_tokens is not None and config.max_num_encoder_input_tokens < 1:
        raise ValueError(f"max_num_encoder_input_tokens must be >= 1, got {config.max_num_encoder_input_tokens}")
    if config.encoder_cache_bytes < 0:
        raise ValueError(f"encoder_cache_bytes must be >= 0, got {config.encoder_cache_bytes}")


def check_kv_offload(config) -> None:
    """``kv_offload_dir`` and ``kv_offloading_size``: a positive bound and a
    folder this process can create and write (made here if missing)."""
    size = config.kv_offloading_size
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"kv_offloading_size must be > 0 GiB, got {size!r}")
    if config.kv_offload_dir is None:
        return
    if not isinstance(config.kv_offload_dir, (str, os.PathLike)) or not str(config.kv_offload_dir).strip():
        raise ValueError(f"kv_offload_dir must be a folder path (or None: off), got {config.kv_offload_dir!r}")
    if config.tensor_parallel_size > 1:
        raise ValueError("kv_offload_dir serves one rank's KV cache; use tensor_parallel_size=1")
    folder = pathlib.Path(config.kv_offload_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"kv_offload_dir {str(folder)!r} cannot be created: {exc}") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"kv_offload_dir {str(folder)!r} is not a writable folder")
    config.kv_offload_dir = str(folder)


def check_kv_scales(config) -> None:
    """``calculate_kv_scales``: a bool, for an fp8 cache, and not beside the
    disk tier (calculated scales differ from run to run, so a tier file from
    another run would be read at scales its bytes were not written at)."""
    if not isinstance(config.calculate_kv_scales, bool):
        raise ValueError(f"calculate_kv_scales must be true or false, got {config.calculate_kv_scales!r}")
    if not config.calculate_kv_scales:
        return
    if not str(config.kv_cache_dtype).startswith("fp8"):
        raise ValueError("calculate_kv_scales scales an fp8 KV cache; set kv_cache_dtype fp8_e4m3 or fp8_e5m2 "
                         f"(got {config.kv_cache_dtype!r})")
    if config.kv_offload_dir is not None:
        raise ValueError("calculate_kv_scales does not combine with kv_offload_dir: the disk tier keeps blocks "
                         "across restarts, and each run calculates its own scales")
