"""Server-sent events: one `data: {json}` per chunk, ending with `data: [DONE]`.

The response object aborts the request in the engine however the stream ends (finished, client
gone, server stopping), so a departed client never keeps KV cache busy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.errors import APIError
from server.generation import Generation
from server.responses import Header, ResponseFormat

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return f"data: {body}\n\n"


async def sse_events(
    gen: Generation, fmt: ResponseFormat, h: Header, include_usage: bool
) -> AsyncIterator[str]:
    for chunk in fmt.opening(h):
        yield sse(chunk)
    try:
        async for piece in gen.pieces():
            yield sse(fmt.text(h, piece))
        yield sse(fmt.last(h, gen.finish_reason, gen.d3d_stats()))
        if include_usage:
            yield sse(fmt.usage(h, gen.usage))
    except APIError as e:
        # The 200 and earlier chunks are already out: report the failure in-band, as OpenAI does.
        yield sse(e.body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` when it ends, however it ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
