"""The engine, loaded in the background: the server answers /health while the models load."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from sglang_d3d.server.errors import UNAVAILABLE, APIError, unavailable

from sglang_d3d.config import EngineConfig

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Any]  # -> an EngineLoop (or the sglang backend's twin)
CycleListener = Callable[[str, Any], None]
PlanListener = Callable[[int, Any, float, int], None]  # batch, plan, seconds, tokens


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
        self._memory: Any = None  # the engine's MemoryReport, once loaded
        self._error: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._listeners: list[CycleListener] = []
        self._plan_listeners: list[PlanListener] = []

    def add_cycle_listener(self, fn: CycleListener) -> None:
        self._listeners.append(fn)

    def add_plan_listener(self, fn: PlanListener) -> None:
        self._plan_listeners.append(fn)

    def start_loading(self) -> None:
        self._thread = threading.Thread(target=self._load, name="d3d-engine-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            engine = self._factory(self._cfg)
            for fn in self._listeners:
                engine.add_cycle_listener(fn)
            for fn in self._plan_listeners:
                engine.add_plan_listener(fn)
            engine.start()
            self._memory = _memory_report(engine)
            # Everything loaded so far (model, imports) lives as long as the server: keep it
            # out of garbage collections, whose pauses would otherwise walk it all (body.py).
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

    def memory(self) -> Any:
        """What the engine's weights and KV caches hold (engine/memory.py), or None."""
        return self._memory if self._engine is not None else None

    def controller(self) -> Any:
        """The running engine's adaptive controller, or None (loading, or none)."""
        return self._running("controller")

    def shared_text(self) -> Any:
        """The running engine's index of earlier requests' text, or None (loading, or none)."""
        return self._running("shared_text")

    def corpus(self) -> Any:
        """The running engine's index of the drafter's corpus, or None (loading, or none)."""
        return self._running("corpus")

    def _running(self, name: str) -> Any:
        """The running engine's `name`, or None while loading or where a backend has none."""
        engine = self._engine
        return None if engine is None else getattr(engine, name, None)

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


def _memory_report(engine: Any) -> Any:
    """The embedded engine's memory by part, logged once; None for a backend that sizes its own
    memory (SGLang's KV pool)."""
    spec = getattr(engine, "engine", None)
    if spec is None or not hasattr(spec, "target"):
        return None
    from sglang_d3d.engine.memory import memory_report

    try:
        report = memory_report(spec)
    except Exception:  # noqa: BLE001 - a report must never keep the server from serving
        log.warning("could not measure the engine's memory", exc_info=True)
        return None
    log.info("%s (--max-batch-size and --max-context size the caches)", report.summary())
    return report
