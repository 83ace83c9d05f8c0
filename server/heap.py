"""Keeping big request bodies from freezing the event loop through the heap: the cyclic
garbage collector paused while one is parsed, and its objects freed a slice at a time.

A 100k-message body becomes some 400k Python objects. Creating them triggers full collections,
and each one walks every tracked object in the process with the GIL held: 0.3-1 s measured on
this project's CPU, during which the event loop (and /health) is frozen. Reference counting
frees the request's objects anyway; only the cycle detector waits until the parse is done.
The engine's objects (model, imports) are frozen out of collections once loaded
(engine_client.EngineHolder), so the collections that do run stay short.

Freeing is the mirror image: dropping the last reference to a list of 100k dicts frees them all
in one C loop, another pause of tens of milliseconds; `release` empties such a list in slices,
between which other threads get the GIL.
"""

from __future__ import annotations

import contextlib
import gc
import threading

PAUSE_ABOVE_BYTES = 256 * 1024  # smaller bodies make too few objects to matter


class GcPause:
    """Collector off while any paused section runs (sections may overlap, across threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = True

    @contextlib.contextmanager
    def paused(self, when: bool = True):
        if not when:
            yield
            return
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._was_enabled:
                    gc.enable()


RELEASE_SLICE = 2048  # objects freed per step


def release(items: list) -> None:
    """Empty `items` (freeing what only it referenced) a slice at a time."""
    while items:
        del items[-RELEASE_SLICE:]
