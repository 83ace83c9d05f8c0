"""The request flow both generation endpoints share: validate, submit, then stream or collect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

from server.args import ServerConfig
from server.engine_client import EngineHolder
from server.errors import APIError, bad_request
from server.generation import Generation
from server.metrics import MetricsRecorder
from server.protocol import SamplingFields
from server.responses import Header, ResponseFormat
from server.sampling import output_budget, sampling_params
from server.streaming import EventStreamResponse, sse_events

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it


@dataclass
class ServerState:
    cfg: ServerConfig
    holder: EngineHolder
    recorder: MetricsRecorder


def check_model(cfg: ServerConfig, model: str | None) -> None:
    if model is not None and model != cfg.model_name:
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{cfg.model_name}`",
            param="model",
            code="model_not_found",
        )


async def serve(
    state: ServerState,
    request: Request,
    body: SamplingFields,
    fmt: ResponseFormat,
    prompt_ids: Callable[[Any], list[int]],  # tokenizer -> ids; raises APIError(400)
    output_limit: int | None,
    prompt_param: str,
) -> Any:
    arrival = time.monotonic()
    check_model(state.cfg, body.model)
    if body.n != 1:
        raise bad_request("only n=1 is supported", "n")
    engine = state.holder.get()
    ids = prompt_ids(engine.tokenizer)
    max_new = output_budget(output_limit, len(ids), state.cfg.engine.max_context, prompt_param)
    try:
        params = sampling_params(body, max_new, engine.tokenizer)
    except ValueError as e:
        raise bad_request(str(e)) from e
    gen = Generation(engine, state.recorder, ids, params, body.stop_strings(), arrival)
    gen.start(state.cfg.retry_after)
    h = Header(fmt.id_prefix + gen.request_id, state.cfg.model_name)
    if body.stream:
        return EventStreamResponse(sse_events(gen, fmt, h, body.include_usage), gen.close)
    text = await until_disconnected(request, gen.text())
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    return fmt.whole(h, text, gen.finish_reason, gen.usage, gen.d3d_stats())


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client hangs up first (then None).

    Non-streaming handlers are not cancelled by Starlette when the client leaves, so without
    this a departed client's request would keep its batch slot until max_tokens.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
