"""EngineLoop: submissions from many threads, aborts, a bounded queue, graceful shutdown."""

from __future__ import annotations

import threading

import pytest
from conftest import reference_greedy
from engine_helpers import make_engine

from sglang_d3d.api import GenerationRequest, QueueFullError
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.loop import EngineLoop


class Collector:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, object] = {}
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, ev) -> None:
        self.tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
        if ev.finished:
            self.final[ev.request_id] = ev
            if len(self.final) >= self.expected:
                self.done.set()


def test_concurrent_submissions_match_target(tiny_models):
    loop = EngineLoop(make_engine(tiny_models, Mode.ASYNC, batch=3))
    loop.start()
    col = Collector()
    prompts = {f"r{i}": [5 + i, 6, 7 + i] for i in range(8)}
    col.expected = len(prompts)
    threads = [
        threading.Thread(target=loop.submit, args=(GenerationRequest(rid, p, SamplingParams(max_new_tokens=15)), col))
        for rid, p in prompts.items()
    ]
    for t in threads:
        t.start()
    assert col.done.wait(60)
    for rid, p in prompts.items():
        assert col.tokens[rid] == reference_greedy(tiny_models[0], p, 15)
    loop.shutdown(drain_timeout=5)
    assert loop.num_running == 0


def test_abort_frees_the_slot(tiny_models):
    eng = make_engine(tiny_models, Mode.ASYNC, batch=1)
    loop = EngineLoop(eng)
    loop.start()
    col = Collector()
    col.expected = 2
    loop.submit(GenerationRequest("long", [5, 6], SamplingParams(max_new_tokens=200)), col)
    loop.submit(GenerationRequest("next", [7, 8], SamplingParams(max_new_tokens=5)), col)
    loop.abort("long")
    assert col.done.wait(30)
    assert col.final["long"].finish_reason == "abort"
    assert col.final["next"].finish_reason == "length"
    loop.shutdown(drain_timeout=5)
    assert eng.scheduler.free_slots == [0]


def test_queue_bound(tiny_models):
    eng = make_engine(tiny_models, Mode.AR, batch=1, max_queue=2)
    for i in range(2):
        eng.submit(GenerationRequest(f"q{i}", [5], SamplingParams(max_new_tokens=2)))
    with pytest.raises(QueueFullError):
        eng.submit(GenerationRequest("q3", [5], SamplingParams(max_new_tokens=2)))


def test_shutdown_drains_then_aborts(tiny_models):
    loop = EngineLoop(make_engine(tiny_models, Mode.SYNC, batch=2))
    loop.start()
    col = Collector()
    col.expected = 2
    loop.submit(GenerationRequest("short", [5], SamplingParams(max_new_tokens=3)), col)
    loop.submit(GenerationRequest("endless", [6], SamplingParams(max_new_tokens=5000 // 20)), col)
    loop.shutdown(drain_timeout=0.01)
    assert col.done.wait(10)
    assert col.final["endless"].finish_reason in ("abort", "length")
    with pytest.raises(RuntimeError):
        loop.submit(GenerationRequest("late", [5], SamplingParams(max_new_tokens=3)), col)
