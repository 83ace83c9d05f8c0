"""Observers of the engine's cycles: a failing one is logged and skipped, never fatal."""

from __future__ import annotations

import logging

from sglang_d3d.speculative import listeners
from sglang_d3d.speculative.listeners import Listeners


def _boom(*args):
    raise RuntimeError("metrics backend down")


def test_a_failing_listener_is_skipped_and_the_others_still_hear(caplog):
    heard = []
    ls = Listeners([_boom, lambda *a: heard.append(a)])
    with caplog.at_level(logging.WARNING, logger=listeners.__name__):
        ls.notify("r1", 3)
        ls.notify("r2", 4)
    assert heard == [("r1", 3), ("r2", 4)]
    assert ls.failures == {id(_boom): 2}
    # the traceback once, not once per cycle
    assert [r.exc_info is not None for r in caplog.records] == [True]


def test_repeated_failures_are_counted_in_the_log(caplog, monkeypatch):
    monkeypatch.setattr(listeners, "LOG_EVERY", 3)
    ls = Listeners([_boom])
    with caplog.at_level(logging.WARNING, logger=listeners.__name__):
        for _ in range(7):
            ls.notify()
    assert ls.failures[id(_boom)] == 7
    assert [m for m in caplog.messages if "times" in m] == [
        f"listener {_boom!r} has failed 3 times", f"listener {_boom!r} has failed 6 times"]


def test_listeners_stay_a_list():
    ls = Listeners()
    ls.append(print)
    assert list(ls) == [print] and len(ls) == 1
