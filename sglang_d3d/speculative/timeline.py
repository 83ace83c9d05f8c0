"""Per-cycle times of the speculative cycle (cycle.py), kept for timeline plots
(benchmarks/plot_timeline.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class CycleTimes:
    """One cycle, times in seconds from its start. Synchronous drafting (before verify) starts
    the cycle, so it runs from 0 to `draft_end`."""

    step: int
    batch: int
    block: int
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
    """The last `maxlen` cycles."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self.cycles: deque[CycleTimes] = deque(maxlen=maxlen)

    def add(self, c: CycleTimes) -> None:
        self.cycles.append(c)

    def to_list(self) -> list[dict]:
        return [c.to_dict() for c in self.cycles]
