"""The HTTP endpoints. Each is a few lines: the shared flow lives in serving.py."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import UNAVAILABLE, error_body
from server.metrics import CONTENT_TYPE
from server.prompts import chat_prompt_ids, completion_prompt_ids
from server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
)
from server.responses import ChatFormat, CompletionFormat
from server.serving import ServerState, serve

_ERROR = {"description": "OpenAI error object: {error: {message, type, param, code}}"}
GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
    400: _ERROR,
    404: _ERROR,
    500: _ERROR,
    503: _ERROR,
}
CHAT, COMPLETION = ChatFormat(), CompletionFormat()

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.d3d


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await serve(
        _state(request),
        request,
        body,
        CHAT,
        lambda tok: chat_prompt_ids(tok, body.messages),
        body.output_limit,  # None: up to the context length, as OpenAI's chat API
        "messages",
    )


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    return await serve(
        _state(request),
        request,
        body,
        COMPLETION,
        lambda tok: completion_prompt_ids(tok, body),
        body.output_limit,
        "prompt",
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    cfg = _state(request).cfg
    return ModelList(data=[ModelCard(id=cfg.model_name, max_model_len=cfg.engine.max_context)])


@router.get("/health", response_model=HealthStatus, responses={503: _ERROR})
async def health(request: Request):
    holder = _state(request).holder
    if holder.ready:
        return HealthStatus()
    if holder.error is not None:
        body = error_body(f"the model failed to load: {holder.error}", UNAVAILABLE, None, "failed")
    else:
        body = error_body("the model is still loading", UNAVAILABLE, None, "loading")
    return JSONResponse(body, status_code=503)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.holder.ready:
        engine = state.holder.get()
        state.recorder.set_queue_sizes(engine.num_running, engine.num_waiting)
    return Response(state.recorder.render(), media_type=CONTENT_TYPE)
