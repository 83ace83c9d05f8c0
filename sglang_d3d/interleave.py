"""The order of side-by-side runs: benchmarks that interleave modes (`d3d bench` prompt by
prompt, `benchmarks/bench_controller.py` group by group, `d3d bench-serving` load by load) start
each round with the next mode in turn, so no mode always runs first. In one process, two
identical ar engines and an async engine that decoded plainly, always in the same order (ar,
async, ar again; concurrency 4), came out 79.0 / 78.7 / 77.1 tok/s in one run and 81.4 / 82.7 /
81.4 in another: an order effect of 0-2.5%, within the noise, which rotating removes by
construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], k: int) -> list[T]:
    """items starting at index k (mod their number): round k's order."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]
