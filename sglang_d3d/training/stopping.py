"""Stopping a training run cleanly on SIGINT or SIGTERM (Ctrl-C, a scheduler's kill,
torchrun passing either on to its workers)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def stop_requests():
    """-> a function telling whether SIGINT or SIGTERM arrived; the loop then stops after the
    step in progress (never half-way through an optimiser update) and saves."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    old = {sig: signal.signal(sig, lambda n, _f: got.append(n))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(got)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
