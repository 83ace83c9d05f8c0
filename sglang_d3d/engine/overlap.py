"""Execution of the target next to the drafter.

On CPU the target runs on a worker thread with its own intra-op threads while the loop thread
runs the drafter; PyTorch releases the GIL inside its kernels, so the two forward passes really
overlap (measured, not assumed: see the per-cycle `Timeline`). On CUDA the same split puts the
target's kernels and the drafter's on different streams/devices.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch


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


@contextmanager
def intra_op_threads(n: int | None):
    """Give the calling thread n intra-op threads for a while (None: leave as is). Used where
    one model runs alone in async mode (synchronous drafting, plain decoding cycles), so the
    cores set aside for the other model do not sit idle."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class CycleTimes:
    """One engine cycle, times in seconds from its start (for timeline plots)."""

    step: int
    batch: int
    block: int
    draft_start: float = 0.0  # synchronous drafting (before verify)
    draft_end: float = 0.0
    verify_start: float = 0.0
    verify_end: float = 0.0
    predraft_start: float = 0.0  # asynchronous pre-drafting (during verify)
    predraft_end: float = 0.0
    end: float = 0.0
    hits: int = 0
    misses: int = 0

    @property
    def overlap(self) -> float:
        lo = max(self.verify_start, self.predraft_start)
        hi = min(self.verify_end, self.predraft_end)
        return max(0.0, hi - lo)

    def to_dict(self) -> dict:
        return {**asdict(self), "overlap": self.overlap}


class Timeline:
    def __init__(self, maxlen: int = 100_000) -> None:
        self.cycles: deque[CycleTimes] = deque(maxlen=maxlen)

    def add(self, c: CycleTimes) -> None:
        self.cycles.append(c)

    def to_list(self) -> list[dict]:
        return [c.to_dict() for c in self.cycles]
