"""One request through the engine: token events in, final text pieces out, usage at the end.

Shared by both endpoints, streaming or not. Stop strings are matched here, token by token, so a
request's text, finish reason and token count do not depend on how the engine batched it.
The engine calls back from its own thread; `RequestStream` hands each event to the asyncio loop
that serves the request, so the HTTP code only ever awaits a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_d3d.server.detokenize import TextStream
from sglang_d3d.server.errors import INTERNAL, APIError, bad_request, unavailable
from sglang_d3d.server.logprobs_out import ScoredToken
from sglang_d3d.server.metrics import MetricsRecorder
from sglang_d3d.server.protocol import D3DStats, Usage

from sglang_d3d.api import GenerationRequest, QueueFullError, RequestTooLongError, TokenEvent
from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.logprobs import TokenLogprob
from sglang_d3d.speculative.stats import RequestStats

ABORT_DRAIN_TIMEOUT = 5.0  # seconds to wait for an aborted request's final event (its stats)


@dataclass
class Piece:
    """What one engine event adds to a choice: final text, and its tokens' log-probabilities
    (if asked for; a token's text may still be held back for a possible stop string)."""

    text: str = ""
    scored: list[ScoredToken] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.scored)


class Generation:
    """One sequence (one choice) of a request through the engine."""

    def __init__(
        self,
        engine: Any,
        recorder: MetricsRecorder,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: Sequence[str],
        arrival: float | None = None,  # time.monotonic() when the request came in
        num_logprobs: int | None = None,  # None: none; k: each token's and k alternatives
        index: int = 0,  # the choice's index in the response
        score: bool = False,  # sum the tokens' log-probabilities even if not reported (best_of)
    ) -> None:
        self.request_id = uuid.uuid4().hex
        self.arrival = time.monotonic() if arrival is None else arrival
        self.index, self.num_logprobs = index, num_logprobs
        self._engine_logprobs = 0 if num_logprobs is None and score else num_logprobs
        self._engine, self._recorder = engine, recorder
        self._prompt_ids, self._params = prompt_ids, params
        self._text = TextStream(engine.tokenizer, prompt_ids, stops, params.min_tokens)
        self._stream: RequestStream | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # the answer's tokens (for `return_token_ids`)
        self.logprob_sum = 0.0  # of the tokens in the answer (best_of ranks by the mean)
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None

    def start(self, retry_after: int) -> None:
        """Submit to the engine; raises APIError (queue full, too long) before any response."""
        start_all([self], retry_after)

    def _request(self) -> GenerationRequest:
        return GenerationRequest(
            self.request_id, self._prompt_ids, self._params, self.arrival, self._engine_logprobs
        )

    def _started(self, stream: RequestStream) -> None:
        self._stream = stream
        # The choices of one request share one prompt: it is counted once.
        prompt = len(self._prompt_ids) if self.index == 0 else 0
        self._tracker = self._recorder.track(self.arrival, prompt)

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / max(1, self.completion_tokens)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it becomes final, one piece per engine event.

        Raises APIError(500) if the engine failed this request."""
        assert self._stream is not None, "start() first"
        try:
            while self.finish_reason is None:
                event = await self._stream.next()
                if piece := self._consume(event):
                    yield piece
                if self._text.stopped:
                    stats = event.stats if event.finished else await self._abort_and_drain()
                    self.finish_reason, self.stats = "stop", stats
                elif event.finished:
                    self._end(event.finish_reason, event.stats, event.error)
                    if tail := self._text.finish():
                        yield Piece(tail)
        finally:
            self.close()

    def _consume(self, event: TokenEvent) -> Piece:
        """What one engine event adds (an event holds a cycle's accepted tokens)."""
        piece, used = Piece(), 0
        logprobs: list[TokenLogprob | None] = list(event.logprobs or [])
        logprobs += [None] * (len(event.token_ids) - len(logprobs))
        texts = []
        for tok, lp in zip(event.token_ids, logprobs):
            if self._text.stopped:
                break  # tokens after a stop string are not part of the answer
            used += 1
            self.token_ids.append(tok)
            offset = self._text.decoded
            texts.append(self._text.add(tok))
            if lp is not None:
                self.logprob_sum += lp.logprob
                if self.num_logprobs is not None:
                    piece.scored.append(ScoredToken(lp, offset))
        piece.text = "".join(texts)
        self.completion_tokens += used
        self._tracker.on_tokens(used)
        return piece

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

    async def collect(self) -> Piece:
        """The whole answer: its text and every token's log-probabilities."""
        whole = Piece()
        async for piece in self.pieces():
            whole.text += piece.text
            whole.scored += piece.scored
        return whole

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt_ids)

    @property
    def usage(self) -> Usage:
        return usage_of([self])

    def d3d_stats(self) -> D3DStats | None:
        s = self.stats
        if s is None:
            return None
        return D3DStats(
            mode=s.mode,
            num_cycles=s.num_cycles,
            copy_cycles=s.copy_cycles,
            mean_accepted_length=s.mean_accepted_length,
            branch_hit_rate=s.branch_hit_rate,
            overlap_fraction=s.overlap_fraction,
            queue_time=s.queue_time,
            prefill_time=s.prefill_time,
        )


def start_all(gens: list[Generation], retry_after: int) -> None:
    """Submit a request's choices together (all or none; they share the prompt's prefill)."""
    engine = gens[0]._engine
    streams = [RequestStream(engine, g.request_id) for g in gens]
    submit_streams(engine, [(st, g._request()) for st, g in zip(streams, gens)], retry_after)
    for st, g in zip(streams, gens):
        g._started(st)


def usage_of(gens: Sequence[Generation]) -> Usage:
    """OpenAI counts the prompt once and the completion tokens of every choice generated."""
    prompt = gens[0].prompt_tokens
    done = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


# ---- the engine's events on the serving loop ----------------------------------------------------
class RequestStream:
    """One submitted request: its TokenEvents, in order, on the serving coroutine's loop."""

    def __init__(self, engine: Any, request_id: str) -> None:
        self._engine, self.request_id = engine, request_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False  # the engine sent the final event
        self._aborted = False

    def on_event(self, event: TokenEvent) -> None:
        """Called on the engine's thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # our loop is closed (server shut down): nobody is listening
            pass

    def submit(self, request: GenerationRequest, retry_after: int) -> None:
        with engine_errors(retry_after):
            self._engine.submit(request, self.on_event)

    async def next(self) -> TokenEvent:
        event = await self._queue.get()
        if event.finished:
            self.finished = True
        return event

    async def drain(self, timeout: float) -> TokenEvent | None:
        """After an abort: wait for the final event (it carries the stats), dropping tokens."""
        event = None
        try:
            async with asyncio.timeout(timeout):
                while not self.finished:
                    event = await self.next()
            return event
        except TimeoutError:
            return None

    def abort(self) -> None:
        """Stop the request in the engine (frees its KV cache); harmless once it finished."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort(self.request_id)


def submit_streams(
    engine: Any, items: list[tuple[RequestStream, GenerationRequest]], retry_after: int
) -> None:
    """Submit the choices of one request together: all are queued or none (the engine shares
    their prompt's prefill). A backend without `submit_all` gets them one by one."""
    if len(items) == 1 or not hasattr(engine, "submit_all"):
        for stream, req in items:
            stream.submit(req, retry_after)
        return
    with engine_errors(retry_after):
        engine.submit_all([(req, stream.on_event) for stream, req in items])


@contextlib.contextmanager
def engine_errors(retry_after: int):
    """The engine's refusals as HTTP errors: queue full 503, too long 400, draining 503."""
    try:
        yield
    except QueueFullError as e:
        raise unavailable(f"the server is at capacity: {e}", "queue_full", retry_after) from e
    except RequestTooLongError as e:
        raise bad_request(str(e), param="max_tokens", code="context_length_exceeded") from e
    except ValueError as e:
        raise bad_request(str(e)) from e
    except RuntimeError as e:  # e.g. the engine is draining for shutdown
        raise unavailable(f"the server cannot take requests: {e}", "unavailable", retry_after) from e
