"""`d3d serve --backend sglang`: SGLang's in-process `sglang.Engine` with the D3D worker, behind
the same submit / TokenEvent-callback shape as the embedded engine's `EngineLoop`.

SGLang runs its scheduler (with D3DWorker) in subprocesses; this process holds SGLang's
tokenizer manager on an asyncio loop of its own thread. Each request is one streaming
`async_generate` call whose chunks become TokenEvents. Per-cycle D3D timings and branch hits stay
in the scheduler process (its log); what comes back is SGLang's per-request speculative counts
(cycles, accepted drafts, the accepted-drafts histogram), from which `RequestStats` and one
`CycleStats` per cycle (times 0, branch hit unknown) are rebuilt for the server's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from sglang_d3d.api import (
    EventCallback,
    GenerationRequest,
    QueueFullError,
    RequestTooLongError,
    TokenEvent,
)
from sglang_d3d.config import EngineConfig, Mode
from sglang_d3d.sglang_worker.backend_convert import (
    cycles_from_stats,
    engine_kwargs,
    event_from_chunk,
    plugin_env,
    sampling_params,
)
from sglang_d3d.speculative.listeners import Listeners

log = logging.getLogger(__name__)


class SGLangEngineLoop:
    # What the D3D worker verifies under (accept.py). Not repetition_penalty: SGLang counts
    # only the output for it, where the embedded engine follows vLLM (prompt and output).
    logit_rules = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "min_p"})

    def __init__(self, cfg: EngineConfig, tokenizer=None, extra_engine_args: dict | None = None):
        self.config = cfg
        self.tokenizer = tokenizer
        self._extra = extra_engine_args or {}
        self._engine = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="d3d-sglang", daemon=True)
        self._inflight: dict[str, EventCallback] = {}
        self._aborted: set[str] = set()
        self._listeners = Listeners()
        self._draining = False
        self.vocab_size: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 1800.0) -> None:
        """Start SGLang (model loading happens here) and return once it serves."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            raise RuntimeError(f"SGLang failed to start: {self._error}") from self._error
        if not self._ready.is_set():
            raise TimeoutError("SGLang did not start in time")

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            import os

            import sglang

            os.environ.update(plugin_env(self.config))  # read by the scheduler subprocesses
            self._engine = sglang.Engine(**{**engine_kwargs(self.config), **self._extra})
            self.vocab_size = self._engine.tokenizer_manager.model_config.vocab_size
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self._inflight):
            self.abort(rid)
        if self._engine is not None:
            self._engine.shutdown()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, on_event: EventCallback) -> None:
        self._check(req)
        self._inflight[req.request_id] = on_event
        asyncio.run_coroutine_threadsafe(self._stream(req, on_event), self._loop)

    def abort(self, request_id: str) -> None:
        if request_id in self._inflight and self._engine is not None:
            self._aborted.add(request_id)
            self._engine.tokenizer_manager.abort_request(rid=request_id)

    def add_cycle_listener(self, fn) -> None:
        self._listeners.append(fn)

    def add_plan_listener(self, fn) -> None:
        """Plans are SGLang's scheduler's here (a fixed block per batch), in its subprocess:
        nothing to report per cycle."""

    controller = None  # no adaptive controller: SGLang schedules the cycles

    @property
    def num_running(self) -> int:
        return min(len(self._inflight), self.config.max_batch_size)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._inflight) - self.config.max_batch_size)

    def _check(self, req: GenerationRequest) -> None:
        if self._draining:
            raise RuntimeError("the engine is shutting down")
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.vocab_size and any(t < 0 or t >= self.vocab_size for t in req.prompt_ids):
            raise ValueError("prompt token id out of the vocabulary")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.config.max_context:
            raise RequestTooLongError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length "
                f"{self.config.max_context}"
            )
        if self.num_waiting >= self.config.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are waiting")

    async def _stream(self, req: GenerationRequest, on_event: EventCallback) -> None:
        sent = 0
        try:
            gen = await self._engine.async_generate(
                input_ids=list(req.prompt_ids),
                sampling_params=sampling_params(req.params),
                stream=True,
                rid=req.request_id,
            )
            async for chunk in gen:
                ev, sent = event_from_chunk(
                    req, chunk, sent, self.config, req.request_id in self._aborted
                )
                if ev.token_ids or ev.finished:
                    self._deliver(on_event, ev)
                if ev.finished:
                    return
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            log.exception("SGLang request %s failed", req.request_id)
            self._deliver(on_event, TokenEvent(req.request_id, [], True, "error", str(e)))
        finally:
            self._inflight.pop(req.request_id, None)
            self._aborted.discard(req.request_id)

    def _deliver(self, on_event: EventCallback, ev: TokenEvent) -> None:
        if ev.finished and ev.stats is not None:
            for c in cycles_from_stats(ev.stats):
                self._listeners.notify(ev.request_id, c)
        try:
            on_event(ev)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
            log.exception("event callback failed for %s", ev.request_id)


def build_engine_loop(cfg: EngineConfig, **extra_engine_args) -> SGLangEngineLoop:
    """What `d3d serve --backend sglang` calls. The returned loop is not started yet (the
    server's EngineHolder starts it on its loading thread)."""
    from sglang_d3d.models.loading import load_tokenizer, resolve_target_path

    tokenizer = load_tokenizer(resolve_target_path(cfg.target_path))
    if cfg.mode is Mode.AR:
        log.info("--mode ar: SGLang without speculative decoding")
    return SGLangEngineLoop(cfg, tokenizer, extra_engine_args)
