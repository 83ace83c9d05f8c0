"""Who runs next: a bounded waiting queue and a fixed set of cache slots.

Requests join between cycles (when a slot is free) and leave when finished or aborted.
Thread-safe: `add` and `abort` are called from server threads, the rest from the loop thread.
"""

from __future__ import annotations

import threading
from collections import deque

from sglang_d3d.api import QueueFullError
from sglang_d3d.engine.sequence import Sequence


class Scheduler:
    def __init__(self, num_slots: int, max_queue: int) -> None:
        self.free_slots = list(range(num_slots))
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"waiting queue is full ({self.max_queue} requests)")
            self.waiting.append(seq)

    def add_all(self, seqs: list[Sequence]) -> None:
        """All or none: the choices of one request are queued together (and so, with free
        slots, admitted in the same step, where they share their prefill)."""
        with self._lock:
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFullError(
                    f"waiting queue cannot take {len(seqs)} more ({self.max_queue} requests)"
                )
            self.waiting.extend(seqs)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def take_aborted(self) -> list[Sequence]:
        """Aborted sequences (running or waiting), removed from the schedule."""
        with self._lock:
            ids, self._aborts = self._aborts, set()
            waiting = [s for s in self.waiting if s.request_id in ids]
            self.waiting = deque(s for s in self.waiting if s.request_id not in ids)
        running = [s for s in self.running if s.request_id in ids]
        for s in running:
            self.release(s)
        return waiting + running

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (FIFO)."""
        admitted = []
        with self._lock:
            while self.waiting and self.free_slots:
                seq = self.waiting.popleft()
                seq.slot = self.free_slots.pop(0)
                admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.free_slots.sort()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)


def plan_chunks(remaining: list[int], budget: int) -> list[int]:
    """Prompt tokens to prefill this step for each prompt still prefilling (FIFO order, as
    `remaining` lists them), at most `budget` in all: earlier prompts finish first, and the
    pass packs as many short prompts as fit. -> sizes for a prefix of `remaining`."""
    sizes = []
    for r in remaining:
        take = min(r, budget)
        if take <= 0:
            break
        sizes.append(take)
        budget -= take
    return sizes
