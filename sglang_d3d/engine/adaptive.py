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
not see), so each plan is re-measured when the time it would lose is covered by its share of a
budget, at most `explore_share` of all cycle time (measured: a fixed interval of 16 kept a poor
drafter's server 17% slower than plain decoding). A plan's share is weighted by the chance that
it is really the best (`explore_weight`): small where it loses by many times the noise of the
two estimates, never under `min_explore` (measured with `bench_controller.py
--also-min-explore 1.0`, where plain decoding wins on a CPU: at concurrency 4, 12 speculative
cycles in 96 requests against 43 for the even split; at 16, 1.03x of ar against 0.93x).
Warm-up cycles of losing plans are what a server pays for this (on a CPU a speculative cycle
at batch 4 costs 4-11 plain steps, `benchmarks/bench_controller.py`), so a plan not yet measured at a bucket gets a first guess:
the nearest measured bucket's time for it, scaled by the ratio of the two buckets'
plain-decoding times, or at least the time of a smaller block of its kind measured here (more
rows are never faster). A plan whose guess is under `dominated` times the best is not warmed
up (re-measurement still reaches it in turn), so a server whose batch size wanders does not
pay every plan's slow warm-up cycles in every bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sglang_d3d.speculative.cycle import Plan

PLAIN = Plan(1)  # target-only decoding: the yardstick for borrowed estimates
# Why `BlockController.choose` returned a plan: the best on its estimates (plain decoding where
# speculation does not clear the margin), a plan still being measured, or one re-measured in
# turn. Operators read them per plan and batch bucket (d3d:controller_plan_cycles_total).
ESTIMATE, WARMUP, EXPLORE = "estimate", "warmup", "explore"


def explore_weight(gap: float, noise: float) -> float:
    """How likely a plan that trails the best by `gap` (a share of the best's tokens/s) is
    really at least as good, when the two estimates' combined relative noise is `noise`:
    twice the normal tail beyond gap/noise, so 1 at a tie."""
    if gap <= 0:
        return 1.0
    return math.erfc(gap / (math.sqrt(2) * max(noise, 1e-9)))


def estimate_noise(spread: float, samples: int, accept: float) -> float:
    """Relative noise of a plan's tokens/s estimate: its cycle time's (the cycles' relative
    spread over the samples the moving average holds) and its acceptance's (`accept`)."""
    return math.sqrt(spread**2 / max(1, samples) + accept**2)


def throughput(rows: int, accept_rates: list[float], block: int, seconds: float) -> float:
    """Tokens/s of a cycle of `block` for `rows` requests that takes `seconds`."""
    return rows * expected_tokens(accept_rates, block) / seconds


def expected_tokens(accept_rates: list[float], block: int) -> float:
    """Tokens per row-cycle for `block` (B-1 drafts): 1 + sum of P(first i drafts accepted)."""
    return expected_curve(accept_rates, block)[block]


def expected_curve(accept_rates: list[float], top: int) -> list[float]:
    """[b] = expected_tokens(accept_rates, b) for every block b in 1..top ([0] unused), in one
    pass: the controller scores every plan of a cycle from one curve per row."""
    curve, total, run = [0.0, 1.0], 1.0, 1.0
    for i in range(top - 1):
        run *= accept_rates[i] if i < len(accept_rates) else (accept_rates[-1] if accept_rates else 0.0)
        total += run
        curve.append(total)
    return curve[: top + 1]


def smoothed(accepted: float, reached: float, prior: float, weight: float) -> float:
    """An acceptance rate from counts, with `prior` worth `weight` cycles of evidence."""
    return (accepted + weight * prior) / (reached + weight)


def count_cycle(reached: list[float], accepted: list[float], tested: int, n: int) -> None:
    """One row-cycle that put `tested` drafts to the test and accepted the first `n`: drafts
    1..n were reached and accepted, draft n+1 (if tested) reached and rejected."""
    _grow(reached, tested)
    _grow(accepted, tested)
    for i in range(min(tested, n + 1)):
        reached[i] += 1
        accepted[i] += i < n


@dataclass
class AcceptCounts:
    """One request's own acceptance evidence (engine/sequence.py): [i] the cycles that put
    draft i+1 to the test after accepting drafts 1..i, and those that accepted it."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    # (key, curve): the controller's curve for these counts (`BlockController._row_curve`),
    # kept until the next `add`
    memo: tuple = field(default=(), repr=False, compare=False)

    def add(self, tested: int, n: int) -> None:
        count_cycle(self.reached, self.accepted, tested, n)
        self.memo = ()


def blend(own: AcceptCounts, prior: list[float], weight: float) -> list[float]:
    """A request's acceptance rates: its own counts, with the served traffic's rates (`prior`)
    worth `weight` cycles, so a new request starts at the traffic's rates and one that has
    shown its kind (a chat turn among arithmetic) moves to its own within a few cycles."""
    return [smoothed(own.accepted[i] if i < len(own.accepted) else 0.0,
                     own.reached[i] if i < len(own.reached) else 0.0, p, weight)
            for i, p in enumerate(prior)]


@dataclass
class BlockController:
    candidates: tuple[Plan, ...]  # Plan(1) = target only
    explore_every: int = 16  # the fewest cycles between two re-measurements at one bucket
    explore_share: float = 0.03  # at most this share of the time goes to re-measuring
    min_explore: float = 0.1  # the least weight of a plan's share (`explore_weight`)
    # Noise of the estimates, for `explore_weight`: a cycle time's relative spread until two
    # cycles have measured it, and the acceptance's (held-out accepted length differs by 15-20%
    # between prompt kinds: GSM8K 3.15, MT-Bench 2.62, benchmarks/results).
    first_spread: float = 0.25
    accept_noise: float = 0.1
    # An estimate left unmeasured grows uncertain as a random walk: `drift` of relative noise
    # per square-root cycle (32% after 1000 cycles), so a plan whose time was inflated by a
    # run of slow cycles is re-timed sooner than its stale gap alone would allow (measured: a
    # controller whose block-4 estimate read 155 ms against 78 ms in service ran at 0.99x of
    # plain decoding over 24 requests at concurrency 1, beside one at 1.20x).
    drift: float = 0.01
    warmup: int = 3
    dominated: float = 0.6
    decay: float = 0.8  # weight of the old estimate in the moving averages
    # A cycle counts at most this many times the estimate: a request's first speculative
    # cycle also reads its prompt into the drafter (measured: a 400-token prompt), and one
    # such spike in a plan's average made a server leave its best plan for ~20 requests.
    spike: float = 2.0
    # Keys whose time is still the start-up calibration's (engine/calibrate.py): timed on
    # synthetic text with the fastest of a few cycles, so a speculative plan reads fast (at
    # batch 4, block 4: 137 ms calibrated against 218 ms served, GSM8K then MT-Bench then
    # code, `benchmarks/bench_controller.py`), and at a decay of 0.8 the estimate took five
    # served cycles, each a loss, to come near. The first served cycle of a speculative
    # plan replaces its calibrated time (bounded by `spike` like any other). Plain decoding
    # can be calibrated slow too (67 ms against 52 ms served, same run), and then looks worse
    # than it is until re-measured: its first served step replaces it where faster, but a
    # slower one only moves the average, since one slow step in its place would make
    # speculation look better until the next re-measurement (measured before calibration: a
    # plain step estimated at 58 ms against 38 ms kept a server speculating at a loss for
    # about 40 requests).
    calibrated: set[tuple[int, Plan]] = field(default_factory=set)
    served_first: bool = True  # False: calibrated times are averaged like any other (before)
    times: dict[tuple[int, Plan], float] = field(default_factory=dict)  # (N, plan) -> seconds
    samples: dict[tuple[int, Plan], int] = field(default_factory=dict)
    spread: dict[tuple[int, Plan], float] = field(default_factory=dict)  # mean |sample/est - 1|
    seen: dict[tuple[int, Plan], int] = field(default_factory=dict)  # cycle of the last sample
    accepted: list[float] = field(default_factory=list)  # [i]: cycles that accepted draft i+1
    reached: list[float] = field(default_factory=list)  # [i]: cycles that proposed draft i+1
    # after accepting drafts 1..i (so that draft i+1 was really put to the test); both are
    # counts over about the last `window` row-cycles that carried drafts, so the rates follow
    # the traffic (held-out accepted length ranges 2.6-3.2 by prompt kind): a server that
    # answered arithmetic for an hour and now gets chat would otherwise go on speculating on
    # the hour's evidence
    window: float = 2000.0
    cycles: int = 0
    # (N, plan) -> seconds banked towards re-measuring that plan at that bucket
    credit: dict[tuple[int, Plan], float] = field(default_factory=dict)
    last_explored: dict[int, int] = field(default_factory=dict)  # bucket -> cycle
    # The drafter's measured acceptance per draft position (models/acceptance.py), so that a
    # controller calibrated at start-up knows what speculating yields before it has tried.
    prior: tuple[float, ...] = ()
    prior_weight: float = 8.0  # cycles' worth of evidence the prior counts for
    margin: float = 0.1  # the share by which speculation must beat plain decoding (half to stay)
    # Each row's expected tokens come from its own acceptance (`evidence` in `choose`), with
    # the traffic's rates worth this many of its cycles: the traffic's rates follow a change
    # of prompt kind only over about `window` row-cycles (measured at concurrency 4: MT-Bench
    # served right after GSM8K ran block 4 at 0.87x of plain decoding on GSM8K's rates).
    row_weight: float = 8.0
    last: Plan | None = None  # the last plan chosen on the estimates (not warm-up, not re-measuring)
    # Tokens a second per row that `choose` expected of the plan it returned (None: not yet
    # estimated): the engine weighs a cycle of copies against it (engine/copy_arms.py).
    expected: float | None = None
    # Plans verified as token trees (speculative/tree.py) yield other than their chain: more
    # at a block of 4 (second guesses), less at 8 (a tree of 5 drafts rarely reaches past
    # depth 4, where the chain of 7 would go on). The rates above stay the chain's, so each
    # such plan keeps plan -> [tokens its trees yielded, tokens their chains would have], over
    # about the last `window` row-cycles, and its expected tokens are scaled by their ratio
    # (`tree_factor`). Measured before this: the controller, scoring trees as chains, ran
    # blocks of 8 whose trees yielded what blocks of 4 did for a dearer draft pass, 2.5-4%
    # behind sync at block 4 (measured with `d3d bench` at batch 1).
    tree_yield: dict[Plan, list[float]] = field(default_factory=dict)
    tree_prior: float = 16.0  # tokens' worth of evidence for a factor of 1 (the chain's)
    reason: str = ESTIMATE  # why `choose` returned its last plan
    # (bucket, plan, reason) -> cycles run: why each plan ran where it did, for metrics (a
    # server that speculates where it loses shows here whether warm-ups, re-measurement or
    # its estimates put it there)
    ran: dict[tuple[int, Plan, str], int] = field(default_factory=dict)
    # The rates and the traffic's curve are kept from cycle to cycle until a cycle tests a
    # draft (`observe`): recomputed every cycle, they and the rows' curves were a third of
    # `choose`, which took 0.2-0.25 ms of a 9 ms plain step on the 4-bit CPU path.
    tested_cycles: int = 0  # cycles whose drafts were put to the test
    memo: dict[tuple, list[float]] = field(default_factory=dict, repr=False, compare=False)

    def accept_rates(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted) for every draft a candidate can
        propose: the drafter's held-out rates (`prior`) worth `prior_weight` cycles where it
        has them, else a +1/+2 prior (0.5 before any cycle tested that position)."""
        return list(self._memo(("rates",), self._rates))

    def _rates(self) -> list[float]:
        drafts = max(p.block for p in self.candidates) - 1
        return [self._rate(i) for i in range(max(drafts, len(self.reached)))]

    def _evidence_key(self) -> tuple:
        """What the rates follow from, beside the counts (`tested_cycles` moves with those)."""
        return (self.tested_cycles, len(self.reached), self.prior, self.prior_weight, self.candidates)

    def _memo(self, what: tuple, compute) -> list[float]:
        """compute()'s value for `what`, kept while the evidence is unchanged (read-only; the
        metrics thread reads rates too, so a value is returned as computed, not read back)."""
        key = (*what, self._evidence_key())
        value = self.memo.get(key)
        if value is None:
            value = compute()
            if len(self.memo) > 64:  # keys of stale evidence
                self.memo.clear()
            self.memo[key] = value
        return value

    def _rate(self, i: int) -> float:
        a = self.accepted[i] if i < len(self.accepted) else 0
        r = self.reached[i] if i < len(self.reached) else 0
        if i < len(self.prior):
            return smoothed(a, r, self.prior[i], self.prior_weight)
        return smoothed(a, r, 0.5, 2.0)

    def choose(self, batch: int, max_block: int | None = None,
               evidence: tuple[AcceptCounts, ...] | list[AcceptCounts] = ()) -> Plan:
        """max_block: the largest block allowed at this batch size (the verify-token budget).
        evidence: the decoding rows' own acceptance counts (rows beyond them, e.g. joining
        requests, count at the traffic's rates)."""
        allowed = self.allowed(max_block)
        rows, batch = batch, bucket(batch)
        self.cycles += 1
        est = self._estimates(batch, allowed, rows, evidence)
        young = [p for p in allowed if self._warming(batch, p, est)]
        if young:
            chosen, self.reason = young[0], WARMUP
        else:
            ranked = sorted(allowed, key=lambda p: -est[p][1])  # all estimated now
            current = self._keep(ranked, est)
            again = self._explore(batch, current, [p for p in ranked if p != current], est)
            chosen, self.reason = (again, EXPLORE) if again else (current, ESTIMATE)
        self.expected = est[chosen][1] / rows if chosen in est else None
        return chosen

    def tree_factor(self, plan: Plan) -> float:
        """Tokens a cycle of `plan` yields over what its chains would have (1 until trees of
        it were seen)."""
        tree, chain = self.tree_yield.get(plan, (0.0, 0.0))
        return (tree + self.tree_prior) / (chain + self.tree_prior)

    def observe_trees(self, plan: Plan, pairs: list[tuple[int, int]]) -> None:
        """pairs: (drafts the tree accepted, drafts its top-1 chain would have) per row of a
        cycle of `plan` verified as trees."""
        if not pairs:
            return
        keep = (1 - 1 / self.window) ** len(pairs)
        tree, chain = self.tree_yield.get(plan, (0.0, 0.0))
        self.tree_yield[plan] = [tree * keep + sum(1 + t for t, _ in pairs),
                                 chain * keep + sum(1 + c for _, c in pairs)]

    def _keep(self, ranked: list[Plan], est: dict[Plan, tuple[float, float]]) -> Plan:
        """The best plan, but a speculative one only where it beats plain decoding by `margin`
        (half that to stay on it). The estimates leave costs out: leaving plain decoding, the
        drafter catches up; a longer cycle holds back a new request's prefill; the acceptance
        rates follow the traffic with a lag (measured at concurrency 4, MT-Bench served right
        after GSM8K: block 4 estimated a few per cent ahead ran 97% of the time at 0.87x of
        plain decoding). And near-ties flip as the batch size moves by one (measured: a
        server at concurrency 4 speculated whenever a request had just finished, 0.93x).
        Where speculation pays (batch 1 on this CPU: 30-50% ahead) the margin changes
        nothing."""
        best = ranked[0]
        need = self.margin / 2 if self.last not in (None, PLAIN) else self.margin
        if best != PLAIN and PLAIN in est and est[best][1] < (1 + need) * est[PLAIN][1]:
            best = PLAIN
        self.last = best
        return best

    def allowed(self, max_block: int | None) -> list[Plan]:
        """The candidates whose block fits in `max_block` tokens per row (plain always does)."""
        return [p for p in self.candidates if max_block is None or p.block <= max(1, max_block)]

    def _estimates(self, batch: int, plans: list[Plan], rows: int | None = None,
                   evidence=()) -> dict[Plan, tuple[float, float]]:
        """plan -> (cycle seconds, tokens/s) for `rows` requests (default: the bucket's size)
        for the plans with an estimate at this bucket, computed once per cycle (the rows'
        acceptance rates are shared by all plans)."""
        rates, est, rows = self.accept_rates(), {}, rows or batch
        tokens = self._batch_tokens(rates, list(evidence)[:rows], rows,
                                    max((p.block for p in plans), default=1))
        for p in plans:
            seconds = self._time(batch, p)
            if seconds is not None:
                seconds = self._within(batch, p, rows, seconds)
                est[p] = (seconds, tokens[p.block] * self.tree_factor(p) / seconds)
        return est

    def _batch_tokens(self, rates: list[float], evidence: list[AcceptCounts], rows: int,
                      top: int) -> list[float]:
        """[b] = tokens a cycle of block b yields for the batch: one curve per row with
        evidence of its own, the traffic's curve for the rest (rows that have put no draft
        to the test yet would blend to the traffic's rates anyway)."""
        own = [self._row_curve(e, rates, top) for e in evidence if e.reached]
        base = self._memo(("curve", top), lambda: expected_curve(rates, top))
        rest = rows - len(own)
        return [sum(c[b] for c in own) + rest * base[b] for b in range(top + 1)]

    def _row_curve(self, e: AcceptCounts, rates: list[float], top: int) -> list[float]:
        """A row's curve (its counts blended with the traffic's `rates`), kept on its counts
        until they or the evidence behind `rates` change."""
        key = (top, self.row_weight, self._evidence_key())
        if not e.memo or e.memo[0] != key:
            e.memo = (key, expected_curve(blend(e, rates, self.row_weight), top))
        return e.memo[1]

    def _within(self, batch: int, plan: Plan, rows: int, seconds: float) -> float:
        """The bucket's time moved to `rows` requests, where the next bucket up has its own
        measurement. A bucket spans sizes whose costs differ by plan: on a CPU a plain step
        at batch 3 costs about what it costs at 2, a speculative cycle half as much again
        (its rows are compute), so comparing at the bucket's own size favoured speculating at
        3 (measured: GSM8K through the server at concurrency 4, 0.93x of ar)."""
        upper = self.times.get((2 * batch, plan))
        return seconds if upper is None else along(seconds, upper, batch, rows)

    def _warming(self, batch: int, plan: Plan, est: dict[Plan, tuple[float, float]]) -> bool:
        """A plan is measured `warmup` times, except that one sample suffices for a plan whose
        score is under `dominated` times the best measured one: re-sampling a plan that lost by
        that much costs slow cycles at every batch size (the server warms up each bucket) and
        re-measurement catches the rare unlucky sample. Plain decoding's calibrated time is
        served once at each bucket before it is trusted: a plain step is the cheapest cycle
        there is, and a calibration that timed it slow would otherwise stand until
        re-measurement reached it (measured: plain at batch 4 calibrated at twice its served
        cost, and the engine speculated through a whole load)."""
        if plan == PLAIN and (batch, plan) in self.calibrated:
            return True
        if self.samples.get((batch, plan), 0) >= self.warmup:
            return False
        if plan not in est:
            return True  # nothing to go on
        return est[plan][1] >= self.dominated * max(score for _, score in est.values())

    def _explore(self, batch: int, current: Plan, others: list[Plan],
                 est: dict[Plan, tuple[float, float]]) -> Plan | None:
        """A plan to re-measure this cycle instead of `current` (the plan kept), or None.
        Every cycle banks `explore_share` of the current plan's cycle time, split among the
        others; a plan is re-measured once its account covers what that costs (the time it
        loses against the current plan for the tokens it yields). So a near-best plan is
        re-measured often, a slow loser rarely, and re-measuring never costs more than
        `explore_share` of the time. A plan estimated better than the kept one (within the
        `margin`) costs nothing to re-measure: it is re-measured every `explore_every`
        cycles, until its estimate takes over or falls back (without this, plain decoding kept
        through a near-tie left a better plan's estimate unmeasured for good)."""
        if not others or self.explore_share <= 0:  # re-measuring switched off
            return None
        best_seconds, best_score = est[current]
        share = self.explore_share * best_seconds / len(others)
        best_noise = self._noise(batch, current)
        due = None
        for plan in sorted(others):
            seconds, score = est[plan]
            gap = 1 - score / best_score
            cost = max(0.0, seconds * gap)
            weight = max(self.min_explore, self._chance(batch, plan, best_noise, gap))
            banked = min(self.credit.get((batch, plan), 0.0) + share * weight, cost)
            self.credit[(batch, plan)] = banked
            if due is None and banked >= cost:
                due = plan
        since = self.cycles - self.last_explored.get(batch, -self.explore_every)
        if due is None or since < self.explore_every:
            return None
        self.credit[(batch, due)] = 0.0
        self.last_explored[batch] = self.cycles
        return due

    def _chance(self, batch: int, plan: Plan, best_noise: float, gap: float) -> float:
        """`explore_weight` of `plan` against the best plan, whose estimate's noise at this
        bucket is `best_noise`."""
        return explore_weight(gap, math.hypot(self._noise(batch, plan), best_noise))

    def _noise(self, batch: int, plan: Plan) -> float:
        key = (batch, plan)
        # the moving average holds about (1 + decay) / (1 - decay) samples
        n = min(self.samples.get(key, 0), round((1 + self.decay) / (1 - self.decay)))
        spread = self.spread.get(key, self.first_spread)
        noise = estimate_noise(spread, n, self.accept_noise if plan.block > 1 else 0.0)
        age = self.cycles - self.seen.get(key, self.cycles)
        return math.sqrt(noise**2 + self.drift**2 * age)

    def score(self, batch: int, plan: Plan) -> float:
        """Tokens per second; for a plan not yet measured at this bucket, the borrowed guess."""
        batch = bucket(batch)
        est = self._estimates(batch, [plan])
        if plan not in est:
            raise KeyError(f"no estimate for {plan} at batch {batch}")
        return est[plan][1]

    def _time(self, batch: int, plan: Plan) -> float | None:
        """The measured cycle time or, for a plan not yet measured at this bucket, the larger
        of two guesses: one borrowed from the nearest bucket that has it (`_borrowed`), and
        the floor that a smaller block of the same kind sets (`_floor`)."""
        own = self.times.get((batch, plan))
        if own is not None:
            return own
        guesses = [t for t in (self._borrowed(batch, plan), self._floor(batch, plan)) if t]
        return max(guesses) if guesses else None

    def _borrowed(self, batch: int, plan: Plan) -> float | None:
        """The nearest bucket's time for this plan, scaled by the ratio of the two buckets'
        plain-decoding times where both are known."""
        others = [b for b, p in self.times if p == plan]
        if not others:
            return None
        near = min(others, key=lambda b: (abs(b.bit_length() - batch.bit_length()), b))
        base, here = self.times.get((near, PLAIN)), self.times.get((batch, PLAIN))
        scale = here / base if plan != PLAIN and base is not None and here is not None else 1.0
        return self.times[(near, plan)] * scale

    def _floor(self, batch: int, plan: Plan) -> float | None:
        """A larger block of the same kind puts more rows through both models, so its cycle
        is at least as slow as the largest smaller block measured at this bucket: a plan that
        loses even at that time need not be warmed up to know it loses."""
        smaller = [p.block for (b, p) in self.times
                   if b == batch and p.overlap == plan.overlap and 1 < p.block < plan.block]
        return self.times[(batch, Plan(max(smaller), plan.overlap))] if smaller else None

    def observe(self, batch: int, plan: Plan, seconds: float, per_row: list[tuple[int, int]]):
        """A cycle of `plan`, the last one chosen, ran. per_row: (drafts proposed, drafts
        accepted) for each row of the cycle."""
        key = (bucket(batch), plan, self.reason)
        self.ran[key] = self.ran.get(key, 0) + 1
        self.observe_time(batch, plan, seconds)
        tested = [(g, n) for g, n in per_row if g > 0]
        if not tested:
            return
        self.tested_cycles += 1
        keep = (1 - 1 / self.window) ** len(tested)  # older evidence fades
        self.reached[:] = [r * keep for r in self.reached]
        self.accepted[:] = [a * keep for a in self.accepted]
        for g, n in tested:
            count_cycle(self.reached, self.accepted, g, n)

    def snapshot(self) -> list[tuple[int, Plan, float, float]]:
        """(bucket, plan, cycle seconds, tokens/s at the bucket's size) of every measured
        pair, for metrics. Another thread may call it while the engine plans: it reads a copy
        of the times (one C-level copy, so no insertion can interleave)."""
        times, rates = list(self.times.items()), self.accept_rates()
        return [(b, p, s, throughput(b, rates, p.block, s) * self.tree_factor(p))
                for (b, p), s in times]

    def reasons(self) -> list[tuple[tuple[int, Plan, str], int]]:
        """((bucket, plan, reason), cycles run) so far, for metrics; like `snapshot`, safe to
        read from another thread (one C-level copy)."""
        return list(self.ran.items())

    def seed_time(self, batch: int, plan: Plan, seconds: float, samples: int) -> None:
        """A time measured before serving (engine/calibrate.py), from `samples` cycles on
        synthetic text, whose acceptance says nothing about real prompts: times only."""
        self.times[(batch, plan)] = seconds
        self.samples[(batch, plan)] = self.samples.get((batch, plan), 0) + samples
        if self.served_first:
            self.calibrated.add((batch, plan))

    def _bounded(self, key: tuple[int, Plan], seconds: float, expected: float) -> float:
        """A cycle's time against the estimate it is expected at: clipped at `spike` times it,
        and its relative miss into the key's spread."""
        seconds = min(seconds, self.spike * expected)
        dev = abs(seconds / expected - 1)
        self.spread[key] = self.decay * self.spread.get(key, dev) + (1 - self.decay) * dev
        return seconds

    def observe_time(self, batch: int, plan: Plan, seconds: float) -> None:
        """A measured cycle time into the moving average (`observe` without acceptance). A
        cycle at a size between the bucket's and the next one's, both estimated, moves both
        ends of the line between them (`between_update`)."""
        key = (bucket(batch), plan)
        self.samples[key] = self.samples.get(key, 0) + 1
        self.seen[key] = self.cycles
        old = self.times.get(key)
        upper_key = (2 * key[0], plan)
        upper = self.times.get(upper_key)
        if old is not None and upper is not None and batch != key[0]:
            seconds = self._bounded(key, seconds, along(old, upper, key[0], batch))
            self.times[key], self.times[upper_key] = between_update(
                old, upper, key[0], batch, seconds, 1 - self.decay)
            return
        if old is not None:
            seconds = self._bounded(key, seconds, old)
            if not replaces(key in self.calibrated, plan, seconds, old):
                seconds = self.decay * old + (1 - self.decay) * seconds
        self.calibrated.discard(key)
        self.times[key] = seconds


def between_update(low: float, high: float, lo: int, batch: int, seconds: float,
                   rate: float) -> tuple[float, float]:
    """(low, high): a bucket's time and the next bucket's, after a cycle of `seconds` at
    `batch` rows between them (`lo` < batch < 2 lo) moved the line between them (`along`) a
    share `rate` of the way to it, each end by its weight in that point (normalised least
    mean squares). Laying the whole miss on the lower end instead, as before, multiplied the
    upper end's error by (batch - lo) / (2 lo - batch), up to 7 at 15 rows of bucket 8: the
    plain step at batch 4 was estimated at 120 ms against 62 served, after a load at
    concurrency 16 had passed through 5-7 rows with batch 8's step estimated 20 ms short, and
    the server then speculated through two loads at concurrency 4 at 0.77-0.85x of ar."""
    w = (batch - lo) / lo
    miss = rate * (seconds - along(low, high, lo, batch))
    norm = (1 - w) ** 2 + w**2
    return max(1e-6, low + miss * (1 - w) / norm), max(1e-6, high + miss * w / norm)


def replaces(calibrated: bool, plan: Plan, seconds: float, old: float) -> bool:
    """Whether a served cycle of `seconds` takes the place of the estimate `old` instead of
    moving the average: where `old` is still the calibration's, for a speculative plan, and
    for plain decoding where the served step is the faster (`BlockController.calibrated`)."""
    return calibrated and (plan != PLAIN or seconds < old)


def along(low: float, high: float, batch: int, rows: int) -> float:
    """Cycle seconds for `rows` requests, linear between `batch` rows (`low` seconds) and
    twice as many (`high`)."""
    return low + (high - low) * (rows - batch) / batch


def bucket(batch: int) -> int:
    """Batch sizes share estimates by power of two (1, 2-3, 4-7, ...): as requests finish the
    batch size drifts, and separate estimates per size would keep the controller exploring."""
    return 1 << (max(1, batch).bit_length() - 1)


def _grow(xs: list[float], n: int) -> None:
    xs.extend([0.0] * max(0, n - len(xs)))
