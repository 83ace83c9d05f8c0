"""Request schemas in the OpenAPI document for endpoints that parse their own bodies.

The generation endpoints read raw bytes (to limit their size and parse them off the event loop),
so FastAPI does not see their request models; these helpers put the models back into
/openapi.json, where clients and the schemathesis fuzzer read them.
"""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_request_schemas(app, models: list[type[BaseModel]]) -> None:
    """Make app.openapi() include `models` (and the models they use) under components."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = base()
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
