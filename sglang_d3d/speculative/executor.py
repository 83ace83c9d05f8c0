"""Where the drafter runs beside the target: a thread of its own and, on CUDA, a stream of its own.

Both hosts (the embedded engine and the SGLang worker) keep the target on their own thread (SGLang's
forward state is thread-local) and hand the drafter's work to an `Executor`, so the two forward
passes are in flight at the same time. PyTorch releases the GIL inside kernels and host syncs, so
on CPU the passes really overlap (measured, not assumed: `CycleTimes.overlap` in timeline.py). On
CUDA, kernels issued from two threads onto the default stream would serialise, hence the stream.

Drafter work that nothing overlaps (the synchronous draft, following a verified outcome) runs on
the caller's thread instead (`run`), still on the drafter's stream, with every core: on CPU a
second thread that once ran with several intra-op threads keeps its own OpenMP team, and with two
teams on two cores every later target pass was slower, even with the drafter idle (measured
side by side in one `d3d bench` process: plain decoding 21-22 tok/s before this change, 27-28
after).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sglang_d3d.speculative.threads import intra_op_threads


class Executor:
    def __init__(self, device: torch.device | str = "cpu", threads: int | None = None) -> None:
        """threads: the thread's intra-op thread count (CPU); None leaves PyTorch's default."""
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="d3d-drafter", initializer=_init_thread, initargs=(threads,)
        )

    def submit(self, fn: Callable, *args) -> Future:
        """-> Future of (result, start, end), perf_counter times; CUDA work is finished at end.
        Runs with the executor's own intra-op threads (see the module note)."""
        return self._pool.submit(self._run, fn, args)

    def run(self, fn: Callable, *args, threads: int | None = None) -> tuple:
        """The same as `submit(...).result()`, on the caller's thread (the drafter's stream):
        for drafter work the caller waits for anyway. `threads`: intra-op threads meanwhile."""
        with intra_op_threads(threads):
            return self._run(fn, args)

    def _run(self, fn: Callable, args) -> tuple:
        start = time.perf_counter()
        with self._stream_ctx(), torch.inference_mode():
            out = fn(*args)
            if self.stream is not None:
                self.stream.synchronize()  # results are read on the caller's thread
        return out, start, time.perf_counter()

    def _stream_ctx(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _init_thread(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
