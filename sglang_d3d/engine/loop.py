"""EngineLoop: runs `SpecEngine.step()` on a thread of its own.

Callers (the HTTP server) submit and abort from any thread; events come back through each
request's callback, called on the loop thread. A calibration handed in (engine/calibrate.py)
runs on the loop thread while no request is in; a submit stops it after its current step and
waits for the engine to be idle again, which takes one cycle of the batch being timed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sglang_d3d.api import EventCallback, GenerationRequest, TokenEvent
from sglang_d3d.config import GrammarSpec
from sglang_d3d.engine.calibrate import Calibration
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.speculative.grammar import GrammarError

log = logging.getLogger(__name__)


class EngineLoop:
    supports_logprobs = True  # TokenEvent.logprobs when GenerationRequest.logprobs is set
    # what it applies to the target's logits (speculative/penalties.py, sampling.py)
    logit_rules = frozenset(
        {"frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_p",
         "min_tokens"}
    )

    def __init__(self, engine: SpecEngine, tokenizer=None,
                 calibration: Calibration | None = None) -> None:
        self.engine = engine
        self._calibration = calibration  # None once done (or never due)
        self._calibrating = threading.Lock()  # held while a calibration run has the engine
        self._waiting = 0  # submits waiting for the engine: a calibration run stops
        self._waiting_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.config = engine.cfg
        self._callbacks: dict[str, EventCallback] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="d3d-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if `spec` does not compile, if the model's vocabulary cannot
        start an answer inside it, or if structured output is off."""
        if self.engine.grammars is None:
            raise GrammarError("structured output is off on this server: the xgrammar package "
                               "is not installed (scripts/requirements-grammar.txt)")
        self.engine.grammars.constraint(spec).chain([])  # compiled once: the engine's is cached

    def submit(self, req: GenerationRequest, on_event: EventCallback) -> None:
        if self._draining:
            raise RuntimeError("the engine is shutting down")
        self._callbacks[req.request_id] = on_event
        try:
            with self._engine_free():
                self.engine.submit(req)
        except Exception:
            self._callbacks.pop(req.request_id, None)
            raise
        with self._wake:
            self._wake.notify()

    def submit_all(self, items: list[tuple[GenerationRequest, EventCallback]]) -> None:
        """Several requests at once, or none (SpecEngine.submit_all): the `n` choices."""
        if self._draining:
            raise RuntimeError("the engine is shutting down")
        for req, cb in items:
            self._callbacks[req.request_id] = cb
        try:
            with self._engine_free():
                self.engine.submit_all([req for req, _ in items])
        except Exception:
            for req, _ in items:
                self._callbacks.pop(req.request_id, None)
            raise
        with self._wake:
            self._wake.notify()

    @property
    def calibrating(self) -> bool:
        """Whether a calibration is still due (it runs while no request is in)."""
        return self._calibration is not None

    @contextmanager
    def _engine_free(self) -> Iterator[None]:
        """The engine without a calibration run on it: one running stops after its step."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            with self._calibrating:
                yield
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with self._wake:
            self._wake.notify()

    def add_cycle_listener(self, fn) -> None:
        self.engine.cycle_listeners.append(fn)

    def add_plan_listener(self, fn) -> None:
        """fn(batch, Plan, seconds, tokens) after every cycle, on the loop thread."""
        self.engine.plan_listeners.append(fn)

    @property
    def controller(self):
        """The adaptive controller (engine/adaptive.py), or None without one; the real one
        while a calibration run stands in for it on the engine."""
        calibration = self._calibration
        return calibration.real if calibration is not None else self.engine.controller

    @property
    def shared_text(self):
        """The index of earlier requests' text (speculative/shared_lookup.py), or None; the
        served one while a calibration run keeps it off the engine."""
        text, calibration = self.engine.shared_text, self._calibration
        return calibration.shared_text if text is None and calibration is not None else text

    @property
    def corpus(self):
        """The index of the drafter's corpus (speculative/corpus_lookup.py), or None."""
        return self.engine.corpus

    @property
    def num_running(self) -> int:
        """Requests decoding; a calibration's synthetic ones are nobody's and not counted."""
        return 0 if self._calibrating.locked() else self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return 0 if self._calibrating.locked() else self.engine.num_waiting

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop taking requests, let the running ones finish up to the timeout, abort the rest."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self._callbacks):
            self.engine.abort(rid)
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _run(self) -> None:
        torch.set_num_threads(self.engine.cfg.target_threads)  # this thread runs the target
        while True:
            with self._wake:
                while not self._stop and not self.engine.has_work() and not self.calibrating:
                    self._wake.wait(timeout=0.5)
                if self._stop and not self.engine.has_work():
                    return
            if self.engine.has_work():
                self._dispatch(self._safe_step())
            else:
                self._calibrate_while_idle()

    def _calibrate_while_idle(self) -> None:
        """Go on with the calibration until done or a request arrives; a failed one is given
        up (the controller learns from traffic, as without calibration)."""
        if self._stop or self._draining:
            self._calibration = None
            return
        stop = lambda: self._waiting > 0 or self._stop or self._draining  # noqa: E731
        with self._calibrating:
            if self.engine.has_work() or stop():
                return
            try:
                if self._calibration.run(stop):
                    self._calibration = None
            except Exception:  # noqa: BLE001 - serving goes on without it
                log.exception("calibration failed; the controller learns from traffic")
                self._calibration = None

    def _safe_step(self) -> list[TokenEvent]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, not the server
            log.exception("engine step failed")
            return self.engine.fail_running(f"{type(e).__name__}: {e}")

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            cb = self._callbacks.get(ev.request_id)
            if ev.finished:
                self._callbacks.pop(ev.request_id, None)
                _log_finished(ev)
            if cb is None:
                continue
            try:
                cb(ev)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
                log.exception("event callback failed for %s", ev.request_id)


def _log_finished(ev: TokenEvent) -> None:
    """One line per finished request: the same RequestStats the metrics are made from."""
    s = ev.stats
    if s is None:
        return
    hit = "-" if s.branch_hit_rate is None else f"{s.branch_hit_rate:.2f}"
    log.info(
        "request %s %s: %d prompt + %d generated tokens, %d cycles, accepted length %.2f, "
        "branch hits %s, overlap %.2f, queue %.3fs, prefill %.3fs, fallbacks %d%s",
        ev.request_id, ev.finish_reason, s.prompt_tokens, s.generated_tokens, s.num_cycles,
        s.mean_accepted_length, hit, s.overlap_fraction, s.queue_time, s.prefill_time,
        s.fallbacks, f", error: {ev.error}" if ev.error else "",
    )
