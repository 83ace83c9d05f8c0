"""The FastAPI application: routes, error handlers, metrics, and the engine loaded in the background.

`create_app` returns at once; the models load on a thread started by the lifespan, and /health
answers 503 until they are ready. On shutdown (after uvicorn has let in-flight responses finish,
up to its graceful timeout) the engine drains what is left and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fastapi import FastAPI
from sglang_d3d.server.args import ServerConfig
from sglang_d3d.server.auth import DocsNeedKey
from sglang_d3d.server.backends import engine_factory
from sglang_d3d.server.engine_holder import EngineFactory, EngineHolder
from sglang_d3d.server.errors import install_error_handlers
from sglang_d3d.server.http_layer import HeaderLimit
from sglang_d3d.server.metrics import CORPUS, SHARED_TEXT, MetricsRecorder
from sglang_d3d.server.protocol import ChatCompletionRequest, CompletionRequest
from sglang_d3d.server.routes import add_request_schemas, router
from sglang_d3d.server.serving import ServerState

log = logging.getLogger(__name__)


def create_app(
    cfg: ServerConfig,
    factory: EngineFactory | None = None,
    on_load_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """factory: builds the engine from cfg.engine (default: the one cfg.backend names).
    on_load_failure: called (from the loading thread) if it raises; without it the server
    stays up and /health reports the error."""
    factory = factory or engine_factory(cfg.backend)
    holder = EngineHolder(factory, cfg.engine, cfg.retry_after, on_load_failure)
    recorder = MetricsRecorder(cfg.model_name, cfg.engine.mode.value)
    holder.add_cycle_listener(recorder.on_cycle)
    holder.add_plan_listener(recorder.on_plan)
    recorder.watch_controller(holder.controller)
    recorder.watch_memory(holder.memory)
    recorder.watch_copy_source(SHARED_TEXT, holder.shared_text)
    recorder.watch_copy_source(CORPUS, holder.corpus)
    state = ServerState(cfg=cfg, holder=holder, recorder=recorder)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        holder.start_loading()
        yield
        state.pools.close()  # compiles still running: their requests get 503
        log.info("shutting down: draining the engine (up to %.0f s)", cfg.drain_timeout)
        await asyncio.to_thread(holder.shutdown, cfg.drain_timeout)

    app = FastAPI(
        title="sglang-d3d",
        summary="OpenAI-compatible server for D3D speculative decoding",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.d3d = state
    install_error_handlers(app, recorder.on_error)
    app.add_middleware(DocsNeedKey, keys=cfg.api_keys, on_error=recorder.on_error)
    app.add_middleware(HeaderLimit, limit=cfg.max_header_bytes, on_error=recorder.on_error)
    app.include_router(router)
    add_request_schemas(app, [ChatCompletionRequest, CompletionRequest])
    return app
