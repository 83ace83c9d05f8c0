"""How much to speculate as the batch grows: pick the cycle plan (block size, and in async mode
whether to pre-draft while the target verifies) with the best measured throughput for the
current batch size.

For a batch of N rows and block B, one cycle yields N * E[tokens | B] tokens and costs
T(N, B) seconds. E[tokens | B] = 1 + sum_{i<B} prod_{j<=i} a_j follows from the per-position
acceptance rates a_j seen so far; T(N, B) is an exponential moving average of measured cycle
times. B = 1 is plain decoding, so speculation is only kept where it measurably beats it.
Pre-drafting is a choice too: where cores are shared (a CPU), running drafter and target at
once slows the verify pass, and at a low branch hit rate drafting after verification (with
every core) is faster; on separate devices the overlap wins. Measured, not assumed.
Each (N, B) pair is measured `warmup` times before the controller trusts it; afterwards, now
and then, one of the other candidates, in turn, is re-measured, so one unlucky sample cannot
rule a block size out for good and the estimates follow the load. Re-measuring a losing plan
costs a slow cycle (after plain decoding the drafter must also catch up on the tokens it did
not see), so the interval starts at `explore_every` cycles and doubles, up to
`max_explore_every`, each time the best plan has not changed since the last re-measurement
(measured: a fixed interval of 16 kept a poor drafter's server 17% slower than plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_d3d.speculative.cycle import Plan


def expected_tokens(accept_rates: list[float], block: int) -> float:
    """Tokens per row-cycle for `block` (B-1 drafts): 1 + sum of P(first i drafts accepted)."""
    total, run = 1.0, 1.0
    for i in range(block - 1):
        run *= accept_rates[i] if i < len(accept_rates) else (accept_rates[-1] if accept_rates else 0.0)
        total += run
    return total


@dataclass
class BlockController:
    candidates: tuple[Plan, ...]  # Plan(1) = target only
    explore_every: int = 16
    max_explore_every: int = 512
    warmup: int = 3
    dominated: float = 0.6
    decay: float = 0.8  # weight of the old estimate in the moving averages
    times: dict[tuple[int, Plan], float] = field(default_factory=dict)  # (N, plan) -> seconds
    samples: dict[tuple[int, Plan], int] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)  # [i]: cycles that accepted draft i+1
    reached: list[int] = field(default_factory=list)  # [i]: cycles that proposed draft i+1
    # after accepting drafts 1..i (so that draft i+1 was really put to the test)
    cycles: int = 0
    explored: int = 0
    # per batch bucket: (interval, cycle of the next re-measurement, best plan at the last one)
    schedule: dict[int, tuple[int, int, Plan | None]] = field(default_factory=dict)

    def accept_rates(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted), with a +1/+2 prior."""
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def choose(self, batch: int, max_block: int | None = None) -> Plan:
        """max_block: the largest block allowed at this batch size (the verify-token budget)."""
        allowed = [p for p in self.candidates if max_block is None or p.block <= max(1, max_block)]
        batch = bucket(batch)
        self.cycles += 1
        young = [b for b in allowed if self._warming(batch, b, allowed)]
        if young:
            return young[0]
        ranked = sorted(allowed, key=lambda b: -self.score(batch, b))
        if len(ranked) > 1 and self._explore_now(batch, ranked[0]):
            self.explored += 1
            others = ranked[1:]
            return others[self.explored % len(others)]
        return ranked[0]

    def _warming(self, batch: int, plan: Plan, allowed: list[Plan]) -> bool:
        """A plan is measured `warmup` times, except that one sample suffices for a plan whose
        score is under `dominated` times the best measured one: re-sampling a plan that lost by
        that much costs slow cycles at every batch size (the server warms up each bucket) and
        re-measurement catches the rare unlucky sample."""
        n = self.samples.get((batch, plan), 0)
        if n == 0:
            return True
        if n >= self.warmup:
            return False
        best = max(self.score(batch, p) for p in allowed if (batch, p) in self.times)
        return self.score(batch, plan) >= self.dominated * best

    def _explore_now(self, batch: int, best: Plan) -> bool:
        """Whether this cycle re-measures another plan; the interval doubles while the best
        plan stays the same and falls back to `explore_every` when it changes."""
        first = (self.explore_every, self.cycles + self.explore_every, best)
        interval, due, last_best = self.schedule.setdefault(batch, first)
        if self.cycles < due:
            return False
        if best == last_best:
            interval = min(2 * interval, self.max_explore_every)
        else:
            interval = self.explore_every
        self.schedule[batch] = (interval, self.cycles + interval, best)
        return True

    def score(self, batch: int, plan: Plan) -> float:
        batch = bucket(batch)
        return batch * expected_tokens(self.accept_rates(), plan.block) / self.times[(batch, plan)]

    def observe(self, batch: int, plan: Plan, seconds: float, per_row: list[tuple[int, int]]):
        """per_row: (drafts proposed, drafts accepted) for each row of the cycle."""
        key = (bucket(batch), plan)
        self.samples[key] = self.samples.get(key, 0) + 1
        old = self.times.get(key)
        self.times[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        for g, n in per_row:
            _grow(self.reached, g)
            _grow(self.accepted, g)
            for i in range(min(g, n + 1)):  # drafts 1..n accepted, draft n+1 rejected
                self.reached[i] += 1
                self.accepted[i] += i < n


def bucket(batch: int) -> int:
    """Batch sizes share estimates by power of two (1, 2-3, 4-7, ...): as requests finish the
    batch size drifts, and separate estimates per size would keep the controller exploring."""
    return 1 << (max(1, batch).bit_length() - 1)


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * max(0, n - len(xs)))
