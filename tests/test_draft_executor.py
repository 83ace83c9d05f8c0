"""The drafter's thread and CUDA stream (sglang_worker/draft_executor.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.sglang_worker.draft_executor import DraftExecutor


def test_work_runs_on_the_drafter_thread_and_reports_its_span():
    ex = DraftExecutor(torch.device("cpu"))
    try:
        out, start, end = ex.submit(lambda x: x * 2, torch.ones(3)).result()
        assert torch.equal(out, torch.full((3,), 2.0)) and start <= end
        assert ex.stream is None  # no stream off CUDA
    finally:
        ex.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_drafter_work_runs_on_its_own_stream_and_is_finished_when_returned():
    ex = DraftExecutor(torch.device("cuda", torch.cuda.current_device()))
    try:
        a = torch.randn(2048, 2048, device="cuda")

        def work():
            return torch.cuda.current_stream(), a @ a

        (stream, out), _, _ = ex.submit(work).result()
        assert stream == ex.stream and stream != torch.cuda.default_stream()
        assert ex.stream.query()  # synchronised before the future resolved
        assert torch.allclose(out, a @ a, rtol=1e-3, atol=1e-2)
    finally:
        ex.shutdown()
