"""The adaptive controller against a simulated server at one batch size: how much re-measuring
losing plans costs when plain decoding wins, and how well it recovers after a burst of
contention (another process, a neighbour) has inflated plain decoding's estimate.

Plan costs are this CPU's at batch 4 (benchmarks/bench_controller.py, step-600 drafter):
plain 38 ms, a block-4 cycle 150 ms for ~2.8 tokens per row, and so on, each cycle jittered by
-10%..+15%; calibration is 20% optimistic, as on synthetic text. Prints throughput as a share
of always decoding plainly, per setting; no model runs, so it takes seconds.

    .venv/bin/python benchmarks/sim_controller.py
"""

from __future__ import annotations

import argparse
import random

from sglang_d3d.engine.adaptive import BlockController, Plan

PLANS = {  # plan -> (seconds per cycle at batch 4, tokens per row per cycle)
    Plan(1): (0.038, 1.0), Plan(4): (0.150, 2.8), Plan(4, True): (0.170, 2.6),
    Plan(8): (0.180, 3.0), Plan(8, True): (0.310, 2.9), Plan(16): (0.285, 3.1),
    Plan(16, True): (0.400, 3.0),
}  # fmt: skip
PRIOR = (1.0, 0.58, 0.47, 0.31, 0.2, 0.2, 0.2)  # the shipped drafter's held-out rates, roughly
BURST = (1000, 1200, 3.0)  # cycles [start, end) run this many times slower


def simulate(min_explore: float, drift: float, burst: bool, cycles: int, seed: int,
             rows: int = 4) -> float:
    """Tokens/s after the burst window, as a share of plain decoding's."""
    rng = random.Random(seed)
    c = BlockController(tuple(PLANS), min_explore=min_explore, drift=drift, prior=PRIOR)
    for p, (t, _) in PLANS.items():
        c.seed_time(rows, p, 0.8 * t, 3)
    start, end, slow = BURST
    spent = tokens = 0.0
    for i in range(cycles):
        plan = c.choose(rows)
        seconds, tau = PLANS[plan]
        seconds *= rng.uniform(0.9, 1.15) * (slow if burst and start <= i < end else 1.0)
        per_row = [_row(rng, plan.block, tau) for _ in range(rows)] if plan.block > 1 else []
        c.observe(rows, plan, seconds, per_row)
        if i >= end:
            spent += seconds
            tokens += sum(n + 1 for _, n in per_row) if per_row else rows
    plain = rows / (PLANS[Plan(1)][0] * 1.025)  # the jitter's mean
    return tokens / spent / plain


def _row(rng: random.Random, block: int, tau: float) -> tuple[int, int]:
    """(drafts, accepted) with each draft kept with probability (tau - 1) / tau."""
    n = 0
    while n < block - 1 and rng.random() < (tau - 1) / tau:
        n += 1
    return block - 1, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=8000)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    if a.cycles <= BURST[1] or a.seeds < 1:
        p.error(f"--cycles must exceed the burst's end ({BURST[1]}) and --seeds be at least 1")
    for min_explore, drift in ((1.0, 0.0), (0.1, 0.0), (0.1, 0.01), (0.3, 0.01), (0.1, 0.02)):
        steady, after = (sum(simulate(min_explore, drift, burst, a.cycles, s)
                             for s in range(a.seeds)) / a.seeds for burst in (False, True))
        print(f"min_explore {min_explore:.1f} drift {drift:.2f}: steady {steady:.3f}, "
              f"after a burst {after:.3f} of plain decoding's tokens/s")


if __name__ == "__main__":
    main()
