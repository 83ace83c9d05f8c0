"""Where the drafter runs while SGLang's target verifies: a thread of its own, and on CUDA a
stream of its own (same GPU) or another GPU (SGLANG_D3D_DRAFT_DEVICE).

The target's forward stays on the scheduler thread (SGLang's forward state is thread-local);
the drafter's work is submitted here first, so its kernels and the target's are in flight at
the same time. PyTorch releases the GIL inside kernels and host syncs, so on CPU the two passes
overlap too (the embedded engine measures the same split).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class DraftExecutor:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="d3d-drafter")

    def submit(self, fn: Callable, *args) -> Future:
        """-> Future of (result, start, end), perf_counter times; CUDA work is finished at end."""

        def timed():
            start = time.perf_counter()
            with self._stream_ctx(), torch.inference_mode():
                out = fn(*args)
                if self.stream is not None:
                    self.stream.synchronize()
            return out, start, time.perf_counter()

        return self._pool.submit(timed)

    def _stream_ctx(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
