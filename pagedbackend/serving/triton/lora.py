"""Adapters in the Triton model, as NVIDIA's vllm_backend serves them.

- Engine settings ``enable_lora`` (true or "true"), ``max_loras``,
  ``max_lora_rank``, ``max_cpu_loras`` (config.pbtxt parameters).
- ``multi_lora.json`` beside ``model.py`` (``{"name": "/path/to/adapter"}``;
  a relative path is taken from that folder) names the adapters served from
  the start; with LoRA on and no such file the load fails, naming it.
- A request picks one with ``lora_name`` in ``sampling_parameters`` or in
  the request parameters of ``generate``; before any work it is refused
  with vllm_backend's words: "LoRA feature is not enabled." or "LoRA <name>
  is not supported, we currently support [...]".
- Beyond vllm_backend: the optional input ``lora_control`` (JSON) lists the
  adapters (``{"action": "list"}``) and, with the server's admin key
  (``$PAGEDBACKEND_ADMIN_KEY`` in the model's environment, which
  ``python -m pagedbackend.serve`` sets), loads, reloads in place and unloads
  them at run time (``{"action": "load", "lora_name", "lora_path",
  "load_inplace", "admin_key"}``, ``{"action": "unload", ...}``): the OpenAI
  server's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
"""
import hmac
import json
import os
import pathlib
import threading
from typing import Dict, List, Optional

from pagedbackend.lora import LoRAError, LoRARequest
from pagedbackend.serving.constants import ADMIN_KEY_ENV

MULTI_LORA_FILE = "multi_lora.json"
NOT_ENABLED = "LoRA feature is not enabled."


class ControlError(ValueError):
    """A refused ``lora_control`` request; ``status`` is the HTTP status the
    OpenAI server answers with (400, 401, 403, 404)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def read_multi_lora(model_dir: str, enabled: bool) -> Dict[str, str]:
    """Adapter name -> folder from ``multi_lora.json`` in ``model_dir`` (the
    model version's folder, beside model.py); nothing when LoRA is off."""
    if not enabled:
        return {}
    path = pathlib.Path(model_dir) / MULTI_LORA_FILE
    try:
        listed = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"Triton backend cannot find {path}.") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(listed, dict) or not all(isinstance(v, str) and v for v in listed.values()):
        raise ValueError(f"{path} must be a JSON object of adapter name -> adapter folder")
    folders = {}
    for name, folder in listed.items():
        folder = pathlib.Path(folder).expanduser()
        folders[name] = str(folder if folder.is_absolute() else path.parent / folder)
    return folders


class TritonAdapters:
    """The model's adapters: names in ``multi_lora.json`` order, then those
    loaded at run time; each gets the next integer id."""

    def __init__(self, engine, enabled: bool, adapters: Dict[str, str], admin_key: Optional[str] = None):
        """``adapters``: name -> folder (``read_multi_lora``), loaded now."""
        self.engine, self.enabled = engine, enabled
        self.admin_key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV) or None
        self._lock = threading.Lock()
        self._requests = {}   # name -> LoRARequest, in the order they were added
        self._next_id = 1
        for name, folder in adapters.items():
            self.load(name, folder)

    @property
    def supported(self) -> List[str]:
        with self._lock:
            return list(self._requests)

    def request_for(self, lora_name) -> Optional[LoRARequest]:
        """The LoRARequest of a request's ``lora_name`` (None: the base model);
        ValueError with vllm_backend's message when it cannot be served."""
        if lora_name is None:
            return None
        if not self.enabled:
            raise ValueError(NOT_ENABLED)
        with self._lock:
            request = self._requests.get(lora_name) if isinstance(lora_name, str) else None
            if request is None:
                raise ValueError(f"LoRA {lora_name} is not supported, we currently support {list(self._requests)}")
            return request

    def load(self, name: str, path: str, inplace: bool = False) -> LoRARequest:
        """Load (or with ``inplace``, reload under its name and id) an adapter."""
        with self._lock:
            known = self._requests.get(name)
            if known is not None and not inplace:
                raise ControlError(f"The lora adapter '{name}' has already been loaded. To load it again "
                                   "from its folder, set 'load_inplace' to true.")
            request = LoRARequest(name, known.lora_int_id if known else self._next_id, path)
            self._next_id += known is None
        try:
            self.engine.add_lora(request, replace=known is not None)
        except LoRAError as exc:
            raise ControlError(str(exc)) from None
        with self._lock:
            self._requests[name] = request
        return request

    def unload(self, name: str) -> None:
        with self._lock:
            request = self._requests.pop(name, None)
        if request is None:
            raise ControlError(f"The lora adapter '{name}' cannot be found.", 404)
        self.engine.remove_lora(request.lora_int_id)

    def control(self, text: str) -> dict:
        """Carry out one ``lora_control`` request; its JSON answer."""
        try:
            order = json.loads(text)
        except (ValueError, RecursionError) as exc:   # RecursionError: nested too deeply to decode
            raise ControlError(f"lora_control is not valid JSON: {exc}") from None
        if not isinstance(order, dict) or order.get("action") not in ("list", "load", "unload"):
            raise ControlError('lora_control must be a JSON object with "action": "list", "load" or "unload"')
        action = order["action"]
        if action == "list":
            with self._lock:
                return {"enabled": self.enabled, "adapters": [
                    {"name": r.lora_name, "id": r.lora_int_id, "path": r.lora_path} for r in self._requests.values()]}
        if not self.enabled:
            raise ControlError(NOT_ENABLED)
        self._check_key(order.get("admin_key"))
        name, path = order.get("lora_name"), order.get("lora_path")
        if not isinstance(name, str) or not name:
            raise ControlError("'lora_name' must be provided.")
        if action == "unload":
            self.unload(name)
            return {"message": f"Success: LoRA adapter '{name}' removed successfully."}
        if not isinstance(path, str) or not path:
            raise ControlError("Both 'lora_name' and 'lora_path' must be provided.")
        self.load(name, path, bool(order.get("load_inplace", False)))
        return {"message": f"Success: LoRA adapter '{name}' added successfully."}

    def _check_key(self, key) -> None:
        if not self.admin_key:
            raise ControlError(f"loading adapters at run time needs the server's admin key (${ADMIN_KEY_ENV} "
                               "in the model's environment; python -m pagedbackend.serve sets it)", 403)
        if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise ControlError("loading adapters at run time needs the server's admin key (admin_key)", 401)
