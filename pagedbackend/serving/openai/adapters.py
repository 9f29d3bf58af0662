"""LoRA adapters as models of the OpenAI API, as vLLM's server names them.

A request's ``model`` may be an adapter of the served Triton model: it runs
on that model with ``lora_name`` set, and its answers carry the adapter's
name. ``GET /v1/models`` lists the adapters after the base model, each with
``parent`` (the Triton model) and ``root`` (its folder). ``POST
/v1/load_lora_adapter`` (``lora_name``, ``lora_path``, ``load_inplace`` to
read a loaded adapter's folder again, a new version for new requests) and
``POST /v1/unload_lora_adapter`` (``lora_name``) need the admin key in the
``pagedbackend-admin-key`` header (``--triton-admin-key``,
``$PAGEDBACKEND_ADMIN_KEY``), which the Triton model checks again.

The adapters are what the Triton model lists (its ``lora_control`` input),
read again at most every ``LIST_TTL_S`` and after every load or unload here.
"""
import hmac
import json
import time
from typing import Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pagedbackend.serving.constants import ADMIN_HEADER
from pagedbackend.serving.openai.protocol import OpenAIError

LIST_TTL_S = 1.0


def _status(message: str) -> int:
    """The HTTP status of a refusal by the Triton model (its messages, serving/triton/lora.py)."""
    if "cannot be found" in message:
        return 404
    if "admin key" in message:
        return 403
    return 400


class Adapters:
    """The adapters of the Triton model ``model_name``."""

    def __init__(self, triton, model_name: str, admin_key: Optional[str]):
        self.triton, self.model_name, self.admin_key = triton, model_name, admin_key
        self._listed: Dict[str, dict] = {}
        self._read_at: Optional[float] = None

    async def listed(self) -> Dict[str, dict]:
        """Adapter name -> ``{"id", "path"}``; none when the model has no ``lora_control`` input."""
        if self._read_at is not None and time.monotonic() - self._read_at < LIST_TTL_S:
            return self._listed
        config = await self.triton.config(self.model_name)
        if "lora_control" not in {i["name"] for i in config.get("input", [])}:
            self._listed = {}
        else:
            answer = await self.triton.control(self.model_name, {"action": "list"})
            self._listed = {a["name"]: a for a in answer.get("adapters", [])}
        self._read_at = time.monotonic()
        return self._listed

    async def find(self, name: str) -> Optional[str]:
        """``name`` when it is an adapter of the model, else None (also when
        the model cannot list them now: the name may be another model's)."""
        try:
            return name if name in await self.listed() else None
        except OpenAIError:
            return None

    async def change(self, request: Request, order: dict) -> str:
        """A load or unload through the Triton model, after the admin key."""
        if not self.admin_key:
            raise OpenAIError(403, "loading adapters at run time needs the admin key: start this server with "
                                   "--triton-admin-key (PAGEDBACKEND_ADMIN_KEY)")
        given = request.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise OpenAIError(401, f"loading adapters at run time needs the admin key in the {ADMIN_HEADER} header")
        try:
            answer = await self.triton.control(self.model_name, {**order, "admin_key": self.admin_key})
        except OpenAIError as exc:
            raise OpenAIError(_status(exc.message), exc.message) from None
        finally:
            self._read_at = None
        return answer["message"]


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return body


def add_routes(app: FastAPI, adapters: Adapters) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _body(request)
        if not body.get("lora_name") or not body.get("lora_path"):
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        order = {"action": "load", "lora_name": body["lora_name"], "lora_path": body["lora_path"],
                 "load_inplace": bool(body.get("load_inplace", False))}
        return PlainTextResponse(await adapters.change(request, order))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _body(request)
        if not body.get("lora_name"):
            raise OpenAIError(400, "'lora_name' must be provided.")
        return PlainTextResponse(await adapters.change(request, {"action": "unload",
                                                                 "lora_name": body["lora_name"]}))


def model_cards(listed: Dict[str, dict], parent: str, created: int) -> list:
    """vLLM's model cards of the adapters: ``parent`` and ``root``."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "pagedbackend",
             "root": adapter.get("path"), "parent": parent} for name, adapter in listed.items()]
