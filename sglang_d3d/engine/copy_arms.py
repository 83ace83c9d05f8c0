"""How a cycle whose rows all found copies runs: its copies with other texts' guesses beside
them (`copy_guesses`, WIDE), or cut to half their length and alone (SHORT), or the
controller's plan instead: chosen by what each way measures on this machine, per batch bucket
(1, 2-3, 4-7, ... as the controller's). Without guesses the wide way is the whole copy alone;
with them, a batch of one also tries the whole copy alone (ALONE).

The guesses add tokens a cycle and cost verify width, and what a token of width costs depends
on the hardware: simulated offline with a token at 1.2% of a plain step they paid 9% on GSM8K;
on this project's two-core CPU (3-4% a token: a 16-token verify 1.4-1.6 plain steps) they
ran level, -3% to +6% in eight side-by-side `d3d bench` runs. And at batch 4 a verify pass is
compute there, not weights read: GSM8K at concurrency 4 in one process, a plain step took 23 ms at batch 1 and at batch 4 alike, a cycle of 8-token copies at
batch 4 51 ms for 2.51 tokens a row, and of 4-token copies 40 ms for 2.32
(`benchmarks/bench_controller.py --also-engine lookup_tokens=4`): the shorter copy gives more
tokens a second where rows are many, the longer where they are few.

So each way of copying first runs `probe` cycles of a bucket, alternating; where the
controller then expects more of its plan than the best way measured, the plan runs; else the
ways go on alternating until each has `warmup` cycles (the two are close, and telling them
apart takes more samples than telling copies from a plan that beats them by half), and then
the fastest serves. Rates are tokens a second per row, so sizes within a bucket compare.

The others are re-tried now and then, so a change of load or text is seen: the first after
`explore_every` cycles of the bucket's leader, and each further one after twice as many as the
last, up to `max_interval`, while the leader stays; a new leader starts over. A re-try whose
cycle ran faster than the leader is re-tried again at once, until one is not or the way leads:
on MBPP on the 4-bit CPU path the first two cycles of each way measured slowest, so the plan
led, and with re-tries only at doubling intervals copies ran in 2% to 56% of the cycles of runs
of one command (`d3d bench --dataset mbpp --modes async-adaptive,ar`). Measured before
this: with 8 warm-up cycles a way for every exact batch size and a fixed re-try every
8th cycle, a load at concurrency 4 made about 15 cycles of copies and so ran almost all of them
in warm-up, copies at twice a plain step's cost (code through the server: 0.86x-0.99x of ar).
At a batch of one (`alone_upto`) the whole copy alone is a third way beside the guesses: there
a verify pass reads weights, so width costs what it is worth only where guesses are often
right. Measured with `d3d bench` at batch 1, each against no guesses at all in the same run:
the two ways ran 2.2-5.7% behind on GSM8K in three runs out of three (a copy alone was not
among them), the three ways 0.9% and 3.5% ahead on GSM8K, and +5.5% and -4.1% on MT-Bench.
Above a batch of one the two ways stay (a third way's warm-up cycles are what short loads at 4
pay for).
Outputs are the same whichever way runs (the target verifies them all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from sglang_d3d.engine.adaptive import bucket
from sglang_d3d.speculative.rates import Rate


class Way(NamedTuple):
    """One way to run a cycle of copies."""

    guesses: bool  # other texts' guesses beside each greedy row's copy, as one token tree
    short: bool  # each copy cut to half the length the verify budget allows


WIDE, ALONE, SHORT = Way(True, False), Way(False, False), Way(False, True)
PLAN = None  # `choose`'s answer for "run the controller's plan"


@dataclass(frozen=True)
class ArmsConfig:
    probe: int = 2  # cycles each way gets, alternating, before the plan may be preferred
    warmup: int = 8  # cycles each way gets before one way of copying is preferred to another
    explore_every: int = 8  # cycles of a new leader before another way is re-tried
    max_interval: int = 64  # the re-tries' interval doubles up to this while the leader stays
    decay: float = 0.98  # the weight of a way's past cycles at each new cycle of it
    alone_upto: int = 1  # batches up to this also try the whole copy alone (0: never)

    def __post_init__(self) -> None:
        if not 1 <= self.probe <= self.warmup or self.explore_every < 2 \
                or self.max_interval < self.explore_every or not 0.0 < self.decay <= 1.0 \
                or self.alone_upto < 0:
            raise ValueError("need 1 <= probe <= warmup, 2 <= explore_every <= max_interval, "
                             f"decay in (0, 1], alone_upto >= 0: {self}")


@dataclass
class Retries:
    """One bucket's re-tries of the ways that are not its leader."""

    leader: object = "none yet"  # the way that served last (a Way or PLAN)
    since: int = 0  # the leader's cycles since it led or since the last re-try
    interval: int = 0  # cycles of the leader before the next re-try
    made: int = 0  # re-tries so far, to take the other ways in turn
    tried: Way | None = None  # the way the last re-try ran, until its cycle is observed
    bar: float = 0.0  # the leader's rate when that re-try was made
    again: Way | None = None  # a way whose re-try beat the leader: it runs again next

    def pick(self, ranked: list, cfg: ArmsConfig, leader_rate: float):
        """The way to run, `ranked` best first: the leader, or now and then another. A way
        whose re-try cycle ran faster than the leader runs again at once, so that a few slow
        first cycles (measured: the first two of each way) do not keep it out for hundreds."""
        if ranked[0] != self.leader:
            self.leader, self.since, self.interval = ranked[0], 0, cfg.explore_every
            self.again = None
        self.since += 1
        if self.again is not None and self.again in ranked[1:]:
            self.since, self.tried, self.again = 0, self.again, None
        elif len(ranked) < 2 or self.since <= self.interval:
            return ranked[0]
        else:
            self.since, self.interval = 0, min(2 * self.interval, cfg.max_interval)
            self.made += 1
            self.tried = ranked[1 + (self.made - 1) % (len(ranked) - 1)]
        self.bar = leader_rate
        return self.tried

    def observed(self, way: Way, rate: float) -> None:
        """A cycle of `way` ran at `rate`: if it was a re-try, whether it runs again."""
        if way == self.tried:
            self.again = way if rate > self.bar else None
            self.tried = None


class CopyArms:
    def __init__(self, guesses: bool = True, cfg: ArmsConfig = ArmsConfig()) -> None:
        self.cfg, self.guesses = cfg, guesses
        self.rates: dict[tuple[int, Way], Rate] = {}  # (bucket, way) -> its cycles
        self.retries: dict[int, Retries] = {}  # bucket -> its re-tries

    def choose(self, batch: int, plan_rate: float | None = None) -> Way | None:
        """For a cycle of `batch` rows that all found copies: the way to verify them, or PLAN
        (None): run the plan, which the controller expects to emit `plan_rate` tokens a
        second per row (None: no controller, copies always)."""
        ways = self.ways(batch)
        fewest = min(ways, key=lambda w: self.rate(batch, w).cycles)
        if self.rate(batch, fewest).cycles < self.cfg.probe:
            return fewest  # alternates, the wide way first
        ranked: list = sorted(ways, key=lambda w: -self.rate(batch, w).per_second)
        best = self.rate(batch, ranked[0]).per_second
        if plan_rate is not None and best < plan_rate:
            ranked.insert(0, PLAN)
        elif self.rate(batch, fewest).cycles < self.cfg.warmup:
            return fewest
        leader_rate = plan_rate if ranked[0] is PLAN else best
        return self.retries.setdefault(bucket(batch), Retries()).pick(ranked, self.cfg, leader_rate)

    def ways(self, batch: int) -> tuple[Way, ...]:
        """The ways a cycle of `batch` rows may run, the wide one first: with guesses, at a
        batch of one also the whole copy alone (see the module's note)."""
        if not self.guesses:
            return ALONE, SHORT
        return (WIDE, ALONE, SHORT) if batch <= self.cfg.alone_upto else (WIDE, SHORT)

    def observe(self, batch: int, way: Way, tokens: int, seconds: float) -> None:
        """A cycle of copies of `batch` rows run `way` emitted `tokens` in all in `seconds`."""
        per_row = tokens / max(1, batch)
        self.rate(batch, way).add(per_row, seconds, self.cfg.decay)
        if bucket(batch) in self.retries:
            self.retries[bucket(batch)].observed(way, per_row / seconds if seconds > 0 else 0.0)

    def rate(self, batch: int, way: Way) -> Rate:
        """The measure of a way at `batch`'s bucket (per row)."""
        return self.rates.setdefault((bucket(batch), way), Rate())
