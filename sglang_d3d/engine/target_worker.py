"""Execution of the target next to the drafter.

On CPU the target runs on a worker thread with its own intra-op threads while the loop thread
runs the drafter; PyTorch releases the GIL inside its kernels, so the two forward passes really
overlap (measured, not assumed: see the per-cycle `Timeline` in timeline.py). On CUDA the same
split puts the target's kernels and the drafter's on different streams/devices.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sglang_d3d.engine.threads import intra_op_threads


class TargetWorker:
    def __init__(self, threads: int, device: str = "cpu") -> None:
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="d3d-target", initializer=_init_thread, initargs=(threads,)
        )
        # On CUDA the target gets a stream of its own: kernels issued from two threads onto
        # the default stream would serialise and there would be nothing to overlap.
        self._stream = torch.cuda.Stream(device) if device.startswith("cuda") else None

    def submit(self, fn: Callable, *args, threads: int | None = None) -> Future:
        """-> Future of (result, start, end) with perf_counter start/end times. `threads`:
        intra-op threads for this call only (prefill runs alone and may take every core)."""

        def timed():
            with intra_op_threads(threads):
                return self._run(fn, args)

        return self._pool.submit(timed)

    def _run(self, fn: Callable, args) -> tuple:
        start = time.perf_counter()
        if self._stream is None:
            out = fn(*args)
        else:
            with torch.cuda.stream(self._stream):
                out = fn(*args)
            self._stream.synchronize()  # results are read on the loop thread
        return out, start, time.perf_counter()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _init_thread(threads: int) -> None:
    torch.set_num_threads(threads)
