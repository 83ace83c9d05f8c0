"""The adaptive block-size controller (engine/adaptive.py)."""

from __future__ import annotations

from sglang_d3d.engine.adaptive import BlockController, Plan, bucket, expected_tokens


def test_controller_prefers_measured_throughput():
    one, four = Plan(1), Plan(4, True)

    assert expected_tokens([0.5, 0.5], 3) == 1 + 0.5 + 0.25
    assert expected_tokens([], 1) == 1.0
    c = BlockController(candidates=(one, four), warmup=1)
    assert c.choose(2) == one and c.choose(2) == one  # the first untried first
    c.observe(2, one, 0.10, [(0, 0), (0, 0)])
    assert c.choose(2) == four
    # drafts always accepted: a 4-block cycle gives 4 tokens per row for 2x the time
    for _ in range(20):
        c.observe(2, four, 0.20, [(3, 3), (3, 3)])
    assert c.choose(2) == four
    c2 = BlockController(candidates=(one, four), warmup=1)
    c2.observe(8, one, 0.10, [])
    for _ in range(20):
        c2.observe(8, four, 0.50, [(3, 0)] * 8)  # drafts always rejected and slow: plain decoding
    assert c2.choose(8) == one


def test_controller_re_measures_every_candidate():
    one, four, eight = Plan(1), Plan(4), Plan(8, True)
    c = BlockController(candidates=(one, four, eight), warmup=1, explore_every=2,
                        max_explore_every=2)
    c.observe(1, one, 0.05, [])
    c.observe(1, four, 5.0, [(3, 0)])  # one unlucky, very slow sample
    c.observe(1, eight, 5.0, [(7, 0)])
    picks = [c.choose(1) for _ in range(12)]
    assert picks.count(one) >= 6 and four in picks and eight in picks  # re-measured in turn


def test_controller_shares_estimates_within_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 16, 17)] == [1, 2, 2, 4, 4, 8, 16, 16]
    c = BlockController(candidates=(Plan(1), Plan(4)), warmup=1)
    c.observe(5, Plan(1), 0.1, [])
    c.observe(6, Plan(4), 0.1, [(3, 3)] * 6)
    assert c.choose(7) == Plan(4)  # measured at 5 and 6, trusted at 7


def test_controller_respects_the_verify_token_budget():
    c = BlockController(candidates=(Plan(1), Plan(4), Plan(16, True)), warmup=1)
    picks = {c.choose(16, max_block=4) for _ in range(10)}
    assert Plan(16, True) not in picks and picks <= {Plan(1), Plan(4)}


def test_re_measuring_backs_off_while_the_best_plan_holds():
    """A drafter that always loses: plain decoding stays best, so re-measurements of the
    speculative plans grow rarer (doubling up to the cap) instead of costing every 16th cycle."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, explore_every=4, max_explore_every=32)
    c.observe(1, one, 0.05, [])
    c.observe(1, four, 0.50, [(3, 0)])
    picks = []
    for _ in range(200):
        p = c.choose(1)
        picks.append(p)
        c.observe(1, p, 0.05 if p == one else 0.50, [] if p == one else [(3, 0)])
    at = [i for i, p in enumerate(picks) if p == four]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {32}
    assert len(at) <= 200 // 16  # a fixed interval of 4 would have re-measured 50 times


def test_re_measuring_speeds_up_again_when_the_best_plan_changes():
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, explore_every=4, max_explore_every=64,
                        decay=0.0)
    c.observe(1, one, 0.05, [])
    c.observe(1, four, 0.50, [(3, 3)])
    for _ in range(100):  # plain decoding best; the interval grows
        p = c.choose(1)
        c.observe(1, p, 0.05 if p == one else 0.50, [] if p == one else [(3, 3)])
    assert c.schedule[1][0] == 64
    c.observe(1, four, 0.01, [(3, 3)])  # the load changed: speculation now wins
    while c.choose(1) != four:
        pass
    for _ in range(200):
        if c.schedule[1][0] == 4:
            break
        p = c.choose(1)
        c.observe(1, p, 0.05 if p == one else 0.01, [] if p == one else [(3, 3)])
    assert c.schedule[1][0] == 4


def test_a_clearly_losing_plan_is_sampled_once():
    one, four, eight = Plan(1), Plan(4), Plan(8)
    c = BlockController(candidates=(one, four, eight), warmup=3, explore_every=1000)
    picks = []
    for _ in range(9):
        p = c.choose(1)
        picks.append(p)
        if p == eight:  # four times slower per token than plain decoding
            c.observe(1, p, 0.40, [(7, 0)])
        elif p == four:  # close to plain decoding (better, in fact): its full warm-up
            c.observe(1, p, 0.06, [(3, 1)])
        else:
            c.observe(1, p, 0.05, [])
    assert picks.count(eight) == 1 and picks.count(one) == 3  # then the best, four
    assert picks[-2:] == [four, four]
