"""The drafter's thread and CUDA stream (speculative/executor.py), shared by both hosts."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from sglang_d3d.speculative.executor import Executor


def test_work_runs_on_the_drafter_thread_and_reports_its_span():
    ex = Executor(torch.device("cpu"))
    try:
        out, start, end = ex.submit(lambda x: x * 2, torch.ones(3)).result()
        assert torch.equal(out, torch.full((3,), 2.0)) and start <= end
        assert ex.stream is None  # no stream off CUDA
    finally:
        ex.shutdown()


def test_thread_counts_per_executor_and_per_call():
    ex = Executor("cpu", threads=1)
    before = torch.get_num_threads()
    try:
        assert ex.submit(torch.get_num_threads).result()[0] == 1  # its own share, always
        out, start, end = ex.run(lambda: (threading.current_thread(), torch.get_num_threads()),
                                 threads=2)
        assert out == (threading.current_thread(), 2) and start <= end  # here, every core
        assert torch.get_num_threads() == before  # for that call only
    finally:
        ex.shutdown()


class _FakeStream:
    """Records the stream calls an Executor makes, for the hand-over order without a GPU."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record_event(self):
        self.log.append(f"record {self.name}")
        return f"event of {self.name}"

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits for {event}")

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self.name}")


def test_drafter_work_waits_for_the_callers_stream_at_every_hand_over(monkeypatch):
    """The drafter's stream must not start before the work the caller queued when it handed
    the drafter its inputs; the caller reads results only after the drafter's stream is done."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(log, "caller"))
    monkeypatch.setattr(Executor, "_stream_ctx", lambda self: contextlib.nullcontext())
    ex = Executor("cpu")
    ex.stream = _FakeStream(log, "drafter")
    try:
        for call in (lambda: ex.submit(log.append, "work").result(), lambda: ex.run(log.append, "work")):
            log.clear()
            call()
            assert log == ["record caller", "drafter waits for event of caller", "work",
                           "synchronize drafter"]
    finally:
        ex.shutdown()


def test_the_drafter_stream_comes_from_a_pool_sglang_never_draws(monkeypatch):
    """torch.cuda.Stream() hands out the next of 32 pooled streams per priority; SGLang draws
    its own at priority 0, so the drafter's is asked at -1."""
    from sglang_d3d.speculative import executor

    asked = {}

    class Stream:
        priority = -1

        def __init__(self, device, priority=0):
            asked.update(device=device, priority=priority)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    executor.drafter_stream(torch.device("cuda", 1))
    assert asked == {"device": torch.device("cuda", 1), "priority": -1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_drafter_stream_is_none_of_the_pooled_priority_0_streams():
    ex = Executor(torch.device("cuda", torch.cuda.current_device()))
    try:
        pooled = [torch.cuda.Stream() for _ in range(64)]  # twice round the pool
        assert all(s != ex.stream for s in pooled) and ex.stream.priority < 0
    finally:
        ex.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_drafter_work_sees_what_the_caller_queued_before_handing_over():
    ex = Executor(torch.device("cuda", torch.cuda.current_device()))
    try:
        for hand_over in (lambda fn: ex.submit(fn).result(), lambda fn: ex.run(fn)):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(50_000_000)  # the caller's stream stays busy a while (~25 ms)
            x.fill_(1.0)  # ... and writes the drafter's input only then
            (total, _, _) = hand_over(lambda x=x: float(x.sum()))
            assert total == float(1 << 20)
    finally:
        ex.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_drafter_work_runs_on_its_own_stream_and_is_finished_when_returned():
    ex = Executor(torch.device("cuda", torch.cuda.current_device()))
    try:
        a = torch.randn(2048, 2048, device="cuda")  # on the caller's stream: the hand-over waits

        def work():
            return torch.cuda.current_stream(), a @ a

        for (stream, out), _, _ in (ex.submit(work).result(), ex.run(work)):
            assert stream == ex.stream and stream != torch.cuda.default_stream()
            assert ex.stream.query()  # synchronised before the result was handed back
            assert torch.allclose(out, a @ a, rtol=1e-3, atol=1e-2)
    finally:
        ex.shutdown()
