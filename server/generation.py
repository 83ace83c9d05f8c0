"""One request through the engine: token events in, final text pieces out, usage at the end.

Shared by both endpoints, streaming or not. Stop strings are matched here, token by token, so a
request's text, finish reason and token count do not depend on how the engine batched it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from server.detokenize import TextStream
from server.engine_client import RequestStream
from server.errors import INTERNAL, APIError
from server.metrics import MetricsRecorder
from server.protocol import D3DStats, Usage
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.api import GenerationRequest
from sglang_d3d.spec.stats import RequestStats

ABORT_DRAIN_TIMEOUT = 5.0  # seconds to wait for an aborted request's final event (its stats)


class Generation:
    def __init__(
        self,
        engine: Any,
        recorder: MetricsRecorder,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: Sequence[str],
        arrival: float | None = None,  # time.monotonic() when the request came in
    ) -> None:
        self.request_id = uuid.uuid4().hex
        self.arrival = time.monotonic() if arrival is None else arrival
        self._engine, self._recorder = engine, recorder
        self._prompt_ids, self._params = prompt_ids, params
        self._text = TextStream(engine.tokenizer, prompt_ids, stops)
        self._stream: RequestStream | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None

    def start(self, retry_after: int) -> None:
        """Submit to the engine; raises APIError (queue full, too long) before any response."""
        stream = RequestStream(self._engine, self.request_id)
        req = GenerationRequest(self.request_id, self._prompt_ids, self._params, self.arrival)
        stream.submit(req, retry_after)
        self._stream = stream
        self._tracker = self._recorder.track(self.arrival, len(self._prompt_ids))

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it becomes final, one piece per engine event.

        Raises APIError(500) if the engine failed this request."""
        assert self._stream is not None, "start() first"
        try:
            while self.finish_reason is None:
                event = await self._stream.next()
                if text := self._consume(event.token_ids):
                    yield text
                if self._text.stopped:
                    stats = event.stats if event.finished else await self._abort_and_drain()
                    self.finish_reason, self.stats = "stop", stats
                elif event.finished:
                    self._end(event.finish_reason, event.stats, event.error)
                    if tail := self._text.finish():
                        yield tail
        finally:
            self.close()

    def _consume(self, token_ids: list[int]) -> str:
        """The text one engine event adds (an event holds a cycle's accepted tokens)."""
        pieces, used = [], 0
        for tok in token_ids:
            if self._text.stopped:
                break  # tokens after a stop string are not part of the answer
            used += 1
            pieces.append(self._text.add(tok))
        self.completion_tokens += used
        self._tracker.on_tokens(used)
        return "".join(pieces)

    async def _abort_and_drain(self) -> RequestStats | None:
        """A stop string matched: end the request in the engine and keep its stats."""
        self._stream.abort()
        final = await self._stream.drain(ABORT_DRAIN_TIMEOUT)
        return final.stats if final is not None else None

    def _end(self, reason: str | None, stats: RequestStats | None, error: str | None) -> None:
        if reason == "error":
            self._tracker.finish("error", stats)
            self.finish_reason = "error"
            raise APIError(500, f"generation failed: {error or 'engine error'}", INTERNAL)
        self.finish_reason = reason or "stop"
        self.stats = stats

    def close(self) -> None:
        """Abort in the engine if the request did not finish (client left, server error)."""
        if self._stream is None:
            return
        self._stream.abort()
        self._tracker.finish(self.finish_reason or "abort", self.stats)

    async def text(self) -> str:
        return "".join([piece async for piece in self.pieces()])

    @property
    def usage(self) -> Usage:
        prompt = len(self._prompt_ids)
        done = self.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def d3d_stats(self) -> D3DStats | None:
        s = self.stats
        if s is None:
            return None
        return D3DStats(
            mode=s.mode,
            num_cycles=s.num_cycles,
            mean_accepted_length=s.mean_accepted_length,
            branch_hit_rate=s.branch_hit_rate,
            overlap_fraction=s.overlap_fraction,
            queue_time=s.queue_time,
            prefill_time=s.prefill_time,
        )
