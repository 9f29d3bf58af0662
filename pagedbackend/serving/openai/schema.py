"""The OpenAPI document of the OpenAI app with the request bodies in it.

The routes read their bodies themselves (``protocol.parse_request``, so that
a bad field gets an OpenAI error object naming it), so FastAPI knows nothing
of them; this adds each route's request model to ``/openapi.json``, which
clients' code generators and the schema fuzzer (``make fuzz``) read."""
from typing import Dict, Type

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def add_request_bodies(app, bodies: Dict[str, Type[BaseModel]]) -> None:
    """``app.openapi`` with ``bodies`` (POST path -> request model) as the
    JSON request body of those routes."""

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                operation = schema["paths"].get(path, {}).get("post")
                if operation is not None:
                    operation["requestBody"] = {"required": True, "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
