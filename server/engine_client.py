"""The server's side of the engine: loading it in the background, and one request's event stream.

The engine calls back from its own thread; `RequestStream` hands each event to the asyncio loop
that serves the request, so the HTTP code only ever awaits a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from sglang_d3d.server.errors import UNAVAILABLE, APIError, bad_request, unavailable

from sglang_d3d.api import (
    GenerationRequest,
    QueueFullError,
    RequestTooLongError,
    TokenEvent,
)
from sglang_d3d.config import EngineConfig

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Any]  # -> an EngineLoop (or the sglang backend's twin)
CycleListener = Callable[[str, Any], None]


class EngineHolder:
    """Builds and starts the engine on a thread, so the server answers /health while loading."""

    def __init__(
        self,
        factory: EngineFactory,
        cfg: EngineConfig,
        retry_after: int,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._factory, self._cfg, self._retry_after = factory, cfg, retry_after
        self._on_failure = on_failure
        self._engine: Any = None
        self._error: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._listeners: list[CycleListener] = []

    def add_cycle_listener(self, fn: CycleListener) -> None:
        self._listeners.append(fn)

    def start_loading(self) -> None:
        self._thread = threading.Thread(target=self._load, name="d3d-engine-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            engine = self._factory(self._cfg)
            for fn in self._listeners:
                engine.add_cycle_listener(fn)
            engine.start()
            # Everything loaded so far (model, imports) lives as long as the server: keep it
            # out of garbage collections, whose pauses would otherwise walk it all (heap.py).
            gc.freeze()
        except Exception as e:  # noqa: BLE001 - reported on /health and in the log
            log.exception("loading the engine failed")
            self._error = f"{type(e).__name__}: {e}"
            if self._on_failure is not None:
                self._on_failure()
            return
        with self._lock:
            if not self._closed:
                self._engine = engine
                log.info("engine ready")
                return
        engine.shutdown(0.0)  # the server stopped while we were loading

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def error(self) -> str | None:
        return self._error

    def get(self) -> Any:
        """The running engine, or a 503 the client can retry."""
        if self._engine is not None:
            return self._engine
        if self._error is not None:
            raise APIError(
                503, f"the model failed to load: {self._error}", UNAVAILABLE, code="failed"
            )
        raise unavailable("the model is still loading", "loading", self._retry_after)

    def shutdown(self, drain_timeout: float) -> None:
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown(drain_timeout)


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
