"""Where the drafter runs beside the target: a thread of its own and, on CUDA, a stream of its own.

Both hosts (the embedded engine and the SGLang worker) keep the target on their own thread (SGLang's
forward state is thread-local) and hand the drafter's work to an `Executor`, so the two forward
passes are in flight at the same time. PyTorch releases the GIL inside kernels and host syncs, so
on CPU the passes really overlap (measured, not assumed: `CycleTimes.overlap` in timeline.py). On
CUDA, kernels issued from two threads onto the default stream would serialise, hence the stream.
Every hand-over orders the two streams: drafter work starts after an event recorded on the
caller's stream when it was handed over, and the caller reads its results after the drafter's
stream is synchronised (`_run`).

Drafter work that nothing overlaps (the synchronous draft, following a verified outcome) runs on
the caller's thread instead (`run`), still on the drafter's stream, with every core: on CPU a
second thread that once ran with several intra-op threads keeps its own OpenMP team, and with two
teams on two cores every later target pass was slower, even with the drafter idle (measured
side by side in one `d3d bench` process: plain decoding 21-22 tok/s before this change, 27-28
after).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sglang_d3d.speculative.threads import intra_op_threads

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, device: torch.device | str = "cpu", threads: int | None = None) -> None:
        """threads: the thread's intra-op thread count (CPU); None leaves PyTorch's default."""
        self.device = torch.device(device)
        self.stream = drafter_stream(self.device) if self.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="d3d-drafter", initializer=_init_thread, initargs=(threads,)
        )

    def submit(self, fn: Callable, *args) -> Future:
        """-> Future of (result, start, end), perf_counter times; CUDA work is finished at end.
        Runs with the executor's own intra-op threads (see the module note)."""
        return self._pool.submit(self._run, fn, args, self._handed_over())

    def run(self, fn: Callable, *args, threads: int | None = None) -> tuple:
        """The same as `submit(...).result()`, on the caller's thread (the drafter's stream):
        for drafter work the caller waits for anyway. `threads`: intra-op threads meanwhile."""
        with intra_op_threads(threads):
            return self._run(fn, args, self._handed_over())

    def _handed_over(self) -> torch.cuda.Event | None:
        """On the caller's thread: an event after everything its stream has queued so far on
        the drafter's device, which the drafter's stream waits for before its first kernel
        (else the drafter could read a tensor the caller is still writing)."""
        if self.stream is None:
            return None
        return torch.cuda.current_stream(self.device).record_event()

    def _run(self, fn: Callable, args, ready: torch.cuda.Event | None) -> tuple:
        start = time.perf_counter()
        with self._stream_ctx(), torch.inference_mode():
            if ready is not None:
                self.stream.wait_event(ready)  # the hand-over in: the caller's work first
            out = fn(*args)
            if self.stream is not None:
                # The hand-over back: the caller's thread reads the results after this.
                self.stream.synchronize()
        return out, start, time.perf_counter()

    def _stream_ctx(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def drafter_stream(device: torch.device) -> torch.cuda.Stream:
    """The drafter's own CUDA stream, one no other code in the process is handed.

    `torch.cuda.Stream()` does not create a stream: it hands out the next of a pool of 32 per
    device and priority, round robin (c10/cuda/CUDAStream.cpp `getStreamFromPool`). SGLang
    takes its streams from the priority-0 pool (scheduler, model runner, attention backends,
    layers), so after 32 of those a priority-0 stream for the drafter would be one of SGLang's,
    and the drafter's kernels would queue behind the target's: no error, no overlap. The pool
    of priority -1 is one nobody else asks for (SGLang never; torch.distributed's high-priority
    option takes the highest-priority pool, not this one). Devices with a single priority
    level have one pool; there the stream may alias, and a warning says so. Not a raw
    `cudaStreamCreate` stream: that one would be a blocking stream, serialised with the legacy
    default stream the embedded engine's target runs on. A drafter a step ahead in the queue
    is harmless: the cycle waits for both passes."""
    stream = torch.cuda.Stream(device, priority=-1)
    if stream.priority == 0:  # clamped into the priority-0 pool
        log.warning("%s has one stream priority: the drafter's stream may alias another", device)
    return stream


def _init_thread(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
