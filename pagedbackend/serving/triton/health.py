"""What ``model.py`` does when its engine fails for good.

The engine has already ended every open request with an error. With
``ModelSettings.unload_on_engine_failure`` (settings.py) the model then
unloads itself, so ``/v2/models/<name>/ready`` stops answering 200 and later
requests get "unknown model" (as vllm_backend does with its health check).
Unloading from inside a model needs tritonserver's
``--model-control-mode=explicit`` (``python -m pagedbackend.serve`` sets it,
with ``--load-model=*``). Otherwise the model stays loaded and refuses every
request with UNAVAILABLE until the server is restarted.
"""
import threading
from typing import Optional

import triton_python_backend_utils as pb_utils


class EngineFailurePolicy:
    def __init__(self, model_name: str, unload: bool):
        self.model_name = model_name
        self.unload = unload   # ModelSettings.unload_on_engine_failure
        self.unloader: Optional[threading.Thread] = None

    def refusal(self, engine_error: Optional[BaseException]) -> Optional[str]:
        """Why a new request is refused (UNAVAILABLE), or None while the engine is healthy."""
        if engine_error is None:
            return None
        then = "the model is being unloaded" if self.unload else "restart the server"
        return f"the engine has failed ({engine_error!r}); {then}"

    def engine_failed(self, exc: BaseException) -> None:
        """AsyncLLMEngine's ``on_failure``: log why, and unload the model from a
        thread of its own (the engine thread must be free to end)."""
        then = "unloading the model" if self.unload else "UNLOAD_ON_ENGINE_FAILURE is false, so it stays loaded"
        pb_utils.Logger.log_error(f"{self.model_name}: the engine failed: {exc!r}; "
                                  f"every open request got an error; {then}")
        if self.unload:
            self.unloader = threading.Thread(target=self._unload, name="unload-on-failure", daemon=True)
            self.unloader.start()

    def _unload(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:
            pb_utils.Logger.log_error(f"{self.model_name}: could not unload the model: {exc}; tritonserver "
                                      "needs --model-control-mode=explicit (python -m pagedbackend.serve sets it)")

    def join(self, timeout: float) -> None:
        if self.unloader is not None:
            self.unloader.join(timeout)
