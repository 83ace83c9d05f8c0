"""The drafter's thread and CUDA stream (speculative/executor.py), shared by both hosts."""

from __future__ import annotations

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_drafter_work_runs_on_its_own_stream_and_is_finished_when_returned():
    ex = Executor(torch.device("cuda", torch.cuda.current_device()))
    try:
        a = torch.randn(2048, 2048, device="cuda")

        def work():
            return torch.cuda.current_stream(), a @ a

        for (stream, out), _, _ in (ex.submit(work).result(), ex.run(work)):
            assert stream == ex.stream and stream != torch.cuda.default_stream()
            assert ex.stream.query()  # synchronised before the result was handed back
            assert torch.allclose(out, a @ a, rtol=1e-3, atol=1e-2)
    finally:
        ex.shutdown()
