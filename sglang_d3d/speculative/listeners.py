"""Observers of the engine's work (the Prometheus recorder, logs, benchmarks' counters).

They run on the engine's thread after each cycle, so a failing observer must not fail the
requests whose books it reads: before this, an exception in a metrics callback left the cycle,
and the engine loop failed every running request (`fail_running`). A failure is logged with
its traceback the first time, then once every `LOG_EVERY` failures with the count.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
LOG_EVERY = 1000


class Listeners(list):
    """A list of callbacks that `notify` calls in turn, each isolated from the others."""

    def __init__(self, fns=()) -> None:
        super().__init__(fns)
        self.failures: dict[int, int] = {}  # id(fn) -> failures so far

    def notify(self, *args) -> None:
        for fn in self:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - an observer's failure must not reach the requests
                self._failed(fn)

    def _failed(self, fn) -> None:
        n = self.failures[id(fn)] = self.failures.get(id(fn), 0) + 1
        if n == 1:
            log.exception("listener %r failed; it is skipped for this call", fn)
        elif n % LOG_EVERY == 0:
            log.warning("listener %r has failed %d times", fn, n)
