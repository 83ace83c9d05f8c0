"""The HTTP endpoints. Each is a few lines: the shared flow lives in serving.py.

The generation endpoints read raw bytes (to limit their size and parse them off the event loop,
serving.py), so FastAPI does not see their request models; `request_body` and
`add_request_schemas` put the models back into /openapi.json, where clients and the
schemathesis fuzzer read them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from sglang_d3d.server.auth import check_api_key
from sglang_d3d.server.errors import UNAVAILABLE, error_body
from sglang_d3d.server.inputs import chat_prompt_ids, completion_prompt_ids
from sglang_d3d.server.metrics import CONTENT_TYPE
from sglang_d3d.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
)
from sglang_d3d.server.responses import ChatFormat, CompletionFormat
from sglang_d3d.server.serving import Endpoint, ServerState, serve
from sglang_d3d.server.tools import forced_tools

REF = "#/components/schemas/{model}"


# ---- request schemas of the endpoints that parse their own bodies ----------------------------
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


# ---- the endpoints -----------------------------------------------------------------------------
_ERROR = {"description": "OpenAI error object: {error: {message, type, param, code}}"}
GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
    400: _ERROR,
    401: _ERROR,
    404: _ERROR,
    413: _ERROR,
    500: _ERROR,
    503: _ERROR,
}
CHAT = Endpoint(
    ChatCompletionRequest, ChatFormat(),
    lambda tok, b: chat_prompt_ids(tok, b.messages, forced_tools(b)), "messages",
)
COMPLETION = Endpoint(CompletionRequest, CompletionFormat(), completion_prompt_ids, "prompt")

router = APIRouter()  # open: /health, and /metrics unless --metrics-need-key
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


def _state(request: Request) -> ServerState:
    return request.app.state.d3d


@v1.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses=GENERATION_RESPONSES,
    openapi_extra=request_body(ChatCompletionRequest),
)
async def chat_completions(request: Request):
    return await serve(_state(request), request, CHAT)


@v1.post(
    "/completions",
    response_model=CompletionResponse,
    responses=GENERATION_RESPONSES,
    openapi_extra=request_body(CompletionRequest),
)
async def completions(request: Request):
    return await serve(_state(request), request, COMPLETION)


@v1.get("/models", response_model=ModelList, responses={401: _ERROR})
async def models(request: Request) -> ModelList:
    cfg = _state(request).cfg
    return ModelList(data=[ModelCard(id=cfg.model_name, max_model_len=cfg.engine.max_context)])


@router.api_route("/health", methods=["GET", "HEAD"], response_model=HealthStatus,
                  responses={503: _ERROR})
async def health(request: Request):
    holder = _state(request).holder
    if holder.ready:
        return HealthStatus()
    if holder.error is not None:
        body = error_body(f"the model failed to load: {holder.error}", UNAVAILABLE, None, "failed")
    else:
        body = error_body("the model is still loading", UNAVAILABLE, None, "loading")
    return JSONResponse(body, status_code=503)


@router.get("/metrics", response_class=Response, responses={401: _ERROR})
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.cfg.metrics_need_key:
        check_api_key(request)
    if state.holder.ready:
        engine = state.holder.get()
        state.recorder.set_queue_sizes(engine.num_running, engine.num_waiting)
    return Response(state.recorder.render(), media_type=CONTENT_TYPE)


router.include_router(v1)
