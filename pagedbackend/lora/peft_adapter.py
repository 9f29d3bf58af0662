"""Reading a PEFT LoRA adapter folder into the weights the pool pages hold.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors``
with, per adapted module, ``<module>.lora_A.weight`` ``[r, in]`` and
``<module>.lora_B.weight`` ``[out, r]`` (PEFT's names, under
``base_model.model.``). The delta of a module is ``x A^T B^T * scaling``,
scaling ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``), with ``r``
and ``lora_alpha`` per module where ``rank_pattern`` / ``alpha_pattern``
say so; the scaling is folded into B here. Modules are the model's linear
projections by their Hugging Face names (``model.hf_projections()``).

Refused at load, with the reason: anything but plain LoRA (DoRA, trained
biases, ``modules_to_save``, trainable token indices, layer replication,
aLoRA, QALoRA, LoRA on parameters), adapters of the embedding or the LM
head, modules the model does not have, shapes that do not fit, ranks above
``max_lora_rank``, non-finite weights, and pickled (``.bin``) weights.
"""
import hashlib
import json
import math
import pathlib
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Mapping, Tuple

import torch

from .request import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Config fields that change what an adapter computes beyond x A^T B^T, with
# the value that leaves them off.
REFUSED_FIELDS = {
    "use_dora": (False, "DoRA adapters (use_dora) are not supported"),
    "modules_to_save": (None, "modules_to_save are not supported: the adapter carries whole copies "
                              "of those layers"),
    "bias": ("none", "adapters that train biases (bias != \"none\") are not supported"),
    "lora_bias": (False, "LoRA biases (lora_bias) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out adapters (Conv1D layers) are not supported"),
    "trainable_token_indices": (None, "trainable token indices (an embedding delta) are not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) is not supported"),
    "use_qalora": (False, "QALoRA adapters (use_qalora) are not supported"),
    "target_parameters": (None, "LoRA on parameters (target_parameters) is not supported"),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>A|B)(?:\.[^.]+)?\.weight$")
_EMBEDDING = re.compile(r"lora_embedding_[AB]")
_LANGUAGE_MODEL = re.compile(r"^(?:model\.)?language_model\.(?:model\.)?")

ModuleShapes = Mapping[str, Tuple[int, int]]   # HF module name -> (in features, out features)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's weights, per module: A ``[r, in]`` and B ``[out, r]``
    (scaling folded in), float32 on the host. ``rank``: the largest ``r``,
    the pages it takes; ``kinds``: the module kinds it adapts (``q_proj``, ...);
    ``content_hash``: of every module's name and weights."""
    path: str
    modules: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    rank: int
    kinds: FrozenSet[str]
    content_hash: bytes

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def load_peft_adapter(path: str, shapes: ModuleShapes, max_lora_rank: int, name: str = "") -> LoRAWeights:
    """The adapter in folder ``path``, checked against the model's modules."""
    what = f"LoRA adapter {name!r} at {path}" if name else f"LoRA adapter at {path}"
    folder = pathlib.Path(path).expanduser()
    if not (folder / CONFIG_FILE).is_file():
        raise LoRAError(f"{what}: no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} "
                        f"and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{what}: {CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{what}: {CONFIG_FILE} is not a JSON object")
    _check_config(config, what)
    tensors = _read_tensors(folder, what)
    pairs = _pair_modules(tensors, shapes, what)
    modules, kinds, digest = {}, set(), hashlib.sha256()
    for module in sorted(pairs):
        a, b = pairs[module]
        r = _check_pair(module, a, b, shapes[module], config, max_lora_rank, what)
        a, b = a.float().contiguous(), (b.float() * _scaling(config, module, r)).contiguous()
        modules[module] = (a, b)
        kinds.add(module.rsplit(".", 1)[-1])
        for part in (module.encode(), a.numpy().tobytes(), b.numpy().tobytes()):
            digest.update(len(part).to_bytes(8, "little") + part)
    rank = max(a.shape[0] for a, _ in modules.values())
    return LoRAWeights(str(folder), modules, rank, frozenset(kinds), digest.digest())


def _check_config(config: dict, what: str) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{what}: a {peft_type} adapter; only LoRA adapters are served")
    for field, (off, reason) in REFUSED_FIELDS.items():
        value = config.get(field, off)
        if value != off and value not in (None, False, [], {}, "none"):
            raise LoRAError(f"{what}: {reason} ({field}={json.dumps(value)})")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"{what}: {CONFIG_FILE} field {field} must be a positive number, got {value!r}")


def _read_tensors(folder: pathlib.Path, what: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        pickled = " (adapter_model.bin is not read: pickled weights can run code; save with " \
                  "safe_serialization=True)" if (folder / "adapter_model.bin").is_file() else ""
        raise LoRAError(f"{what}: no {WEIGHTS_FILE}{pickled}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{what}: {WEIGHTS_FILE} cannot be read: {exc}") from None


def _pair_modules(tensors: Dict[str, torch.Tensor], shapes: ModuleShapes,
                  what: str) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from the file's keys, every key accounted for."""
    for key in tensors:   # PEFT saves whole copies of these layers beside their LoRA weights
        layer = next((name for name in ("embed_tokens", "lm_head") if name in key.split(".")), None)
        if layer is not None or _EMBEDDING.search(key):
            raise LoRAError(f"{what}: it adapts {layer or 'embed_tokens'} ({key}); LoRA on the embedding and "
                            f"the LM head is not supported, only on the linear projections ({_kinds(shapes)})")
    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{what}: unexpected tensor {key} (a LoRA adapter holds only lora_A and "
                            "lora_B weights)")
        module = match["module"]
        if module not in shapes and f"model.{module}" in shapes:
            module = f"model.{module}"
        if module not in shapes:   # a multimodal checkpoint's text decoder (Gemma 3, Mistral 3)
            module = _LANGUAGE_MODEL.sub("model.", module)
        if module not in shapes:
            raise LoRAError(f"{what}: it adapts {match['module']}, which is not a linear projection of "
                            f"this model's text decoder ({_kinds(shapes)})")
        parts.setdefault(module, {})[match["part"]] = tensor
    if not parts:
        raise LoRAError(f"{what}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            raise LoRAError(f"{what}: {module} has lora_{next(iter(found))} without "
                            f"lora_{'B' if 'A' in found else 'A'}")
    return {module: (found["A"], found["B"]) for module, found in parts.items()}


def _check_pair(module: str, a: torch.Tensor, b: torch.Tensor, shape: Tuple[int, int], config: dict,
                max_lora_rank: int, what: str) -> int:
    """The module's rank, once A and B fit the model's projection and the limit."""
    in_features, out_features = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1]:
        raise LoRAError(f"{what}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this "
                        f"model's projection needs [r, {in_features}] and [{out_features}, r]")
    r = a.shape[0]
    if r > max_lora_rank:
        raise LoRAError(f"{what}: rank {r} of {module} exceeds max_lora_rank={max_lora_rank} "
                        "(raise the engine setting max_lora_rank to serve it)")
    declared = _pattern(config.get("rank_pattern"), module, config["r"])
    if declared != r:
        raise LoRAError(f"{what}: {module} has rank {r} but {CONFIG_FILE} says r={declared}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAError(f"{what}: {module} has weights that are not finite numbers")
    return r


def _scaling(config: dict, module: str, r: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = float(_pattern(config.get("alpha_pattern"), module, config["lora_alpha"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns, module: str, default):
    """The value of the first pattern key that names ``module`` (PEFT's
    ``rank_pattern`` / ``alpha_pattern``: a name suffix or a regular expression)."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key):
            return value
        try:
            if re.fullmatch(rf"(.*\.)?(?:{key})", module):
                return value
        except re.error:
            continue
    return default


def _kinds(shapes: ModuleShapes) -> str:
    return ", ".join(sorted({name.rsplit(".", 1)[-1] for name in shapes}))
