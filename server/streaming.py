"""Server-sent events: one `data: {json}` per chunk, ending with `data: [DONE]`.

With `n` > 1 the choices' chunks interleave as their tokens arrive, each naming its index. The
response object aborts the requests in the engine however the stream ends (finished, client
gone, server stopping), so a departed client never keeps KV cache busy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from pydantic import BaseModel
from sglang_d3d.server.errors import APIError, ErrorListener
from sglang_d3d.server.generation import Generation, Piece, usage_of
from sglang_d3d.server.logprobs_out import TokenTexts
from sglang_d3d.server.responses import Answer, Header, ResponseFormat, as_call
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return f"data: {body}\n\n"


async def sse_events(
    gens: Sequence[Generation],
    fmt: ResponseFormat,
    h: Header,
    include_usage: bool,
    names: TokenTexts | None,
    on_error: ErrorListener | None = None,
    calls: bool = False,
) -> AsyncIterator[str]:
    """`calls`: each answer is a forced tool call (server/tools.py), sent whole at its end."""
    for chunk in fmt.opening(h, len(gens)):
        yield sse(chunk)
    held = [Answer(i, "", None, [] if g.num_logprobs is not None else None)
            for i, g in enumerate(gens)]  # a forced call's text, until it is whole
    try:
        async for i, piece in merged(gens):
            g = gens[i]
            if piece is None:
                finish = g.finish_reason
                if calls:
                    answer = as_call(replace(held[i], finish=finish))
                    for chunk in _call_chunks(fmt, h, answer, names):
                        yield sse(chunk)
                    finish = answer.finish
                yield sse(fmt.last(h, i, finish, g.d3d_stats()))
                continue
            if calls:
                held[i].text += piece.text
                if held[i].scored is not None:
                    held[i].scored += piece.scored
                continue
            scored = piece.scored if g.num_logprobs is not None else None
            yield sse(fmt.text(h, Answer(i, piece.text, None, scored), names))
        if include_usage:
            yield sse(fmt.usage(h, usage_of(gens)))
    except APIError as e:
        # The 200 and earlier chunks are already out: report the failure in-band, as OpenAI does.
        if on_error is not None:
            on_error(e.status, e.type, e.code)
        yield sse(e.body())
    yield DONE


def _call_chunks(fmt: ResponseFormat, h: Header, a: Answer,
                 names: TokenTexts | None) -> list[BaseModel]:
    """A finished forced call: its tool_calls, or its text where `max_tokens` cut it."""
    if a.tool_calls:
        return [fmt.calls(h, a, names)]
    return [fmt.text(h, a, names)] if a.text else []


async def merged(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(choice index, piece) as each arrives; (index, None) when that choice has finished."""
    if len(gens) == 1:
        async for piece in gens[0].pieces():
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for piece in g.pieces():
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except APIError as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while True:
                i, piece, error = await queue.get()
                if error is not None:
                    raise error
                yield i, piece
                if piece is None:
                    break
    finally:
        for t in tasks:
            t.cancel()


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
