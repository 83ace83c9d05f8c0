"""The adaptive block-size controller (engine/adaptive.py)."""

from __future__ import annotations

import pytest

from sglang_d3d.engine.adaptive import (
    ESTIMATE,
    EXPLORE,
    WARMUP,
    AcceptCounts,
    BlockController,
    Plan,
    along,
    blend,
    bucket,
    estimate_noise,
    expected_curve,
    expected_tokens,
    explore_weight,
)


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
                        explore_share=0.5)
    c.observe(1, one, 0.05, [])
    c.observe(1, four, 0.5, [(3, 0)])  # one unlucky, slow sample
    c.observe(1, eight, 0.5, [(7, 0)])
    picks = [c.choose(1) for _ in range(2000)]
    # re-measured in turn, rarely: each lost by ten times the noise of one sample
    assert picks.count(one) >= 1900 and four in picks and eight in picks


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


def _run(c: BlockController, cycles: int, seconds: dict, per_row: dict) -> list:
    picks = []
    for _ in range(cycles):
        p = c.choose(1)
        picks.append(p)
        c.observe(1, p, seconds[p], per_row[p])
    return picks


def test_re_measuring_costs_at_most_its_share_of_the_time():
    """A drafter that always loses: plain decoding stays best, and the slow speculative cycles
    spent re-measuring stay within `explore_share` of the time; a plan that loses by little
    is re-measured more often than one that loses by much."""
    one, four, eight = Plan(1), Plan(4), Plan(8)
    seconds = {one: 0.05, four: 0.06, eight: 0.50}
    per_row = {one: [], four: [(3, 0)], eight: [(7, 0)]}
    c = BlockController(candidates=(one, four, eight), warmup=1, explore_every=4,
                        explore_share=0.05)
    picks = _run(c, 8000, seconds, per_row)
    lost = sum(seconds[p] - seconds[one] for p in picks[3:])  # past the warm-up
    assert lost <= 0.05 * sum(seconds[p] for p in picks[3:])
    assert picks[3:].count(four) > 3 * picks[3:].count(eight) > 0


def test_plans_that_cannot_win_are_re_measured_least():
    """Where plain decoding wins by far more than the estimates' noise (a CPU at batch 4),
    re-measuring costs about `min_explore` of the budget; a plan that trails by about the
    acceptance's noise is re-measured several times as much."""
    def lost_share(four_seconds: float) -> float:
        one, four = Plan(1), Plan(4)
        seconds, per_row = {one: 0.05, four: four_seconds}, {one: [], four: [(3, 1)]}
        c = BlockController(candidates=(one, four), warmup=1, explore_every=4)
        picks = _run(c, 20000, seconds, per_row)[3:]
        # a block-4 cycle yields 2 tokens, which plain decoding makes in 0.1 s
        lost = picks.count(four) * (four_seconds - 2 * seconds[one])
        return lost / sum(seconds[p] for p in picks)

    far, near = lost_share(0.30), lost_share(0.11)  # 0.33x and 0.91x of plain decoding
    assert 0 < far <= 1.5 * 0.1 * 0.03  # min_explore of explore_share, and one cycle more
    assert 3 * far < near <= 0.03


def test_explore_weight_is_the_chance_of_being_best():
    assert explore_weight(0.0, 0.1) == 1.0 and explore_weight(-0.1, 0.1) == 1.0
    assert explore_weight(0.1, 0.1) == pytest.approx(0.3173, abs=1e-4)  # one sigma
    assert explore_weight(0.4, 0.1) < 1e-4 < explore_weight(0.2, 0.1) < explore_weight(0.1, 0.2)


def test_estimate_noise_falls_with_samples_to_the_acceptance_noise():
    assert estimate_noise(0.2, 1, 0.0) == pytest.approx(0.2)
    assert estimate_noise(0.2, 4, 0.0) == pytest.approx(0.1)
    assert estimate_noise(0.0, 9, 0.1) == pytest.approx(0.1)
    assert estimate_noise(0.3, 0, 0.0) == pytest.approx(0.3)  # no samples: the spread itself


def test_a_plan_that_becomes_faster_takes_over():
    one, four = Plan(1), Plan(4)
    seconds, per_row = {one: 0.05, four: 0.50}, {one: [], four: [(3, 3)]}
    c = BlockController(candidates=(one, four), warmup=1, explore_every=4, decay=0.0)
    assert _run(c, 300, seconds, per_row)[-1] == one
    seconds[four] = 0.02  # the load changed: speculation now wins
    # it lost by 60% with no noise, so it is re-measured only at the least weight; still it
    # is, and takes over
    assert _run(c, 3000, seconds, per_row)[-100:].count(four) >= 90


def test_a_clearly_losing_plan_is_sampled_once():
    one, four, eight = Plan(1), Plan(4), Plan(8)
    c = BlockController(candidates=(one, four, eight), warmup=3, explore_share=0.0)
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


def test_a_new_batch_bucket_borrows_the_nearest_estimates():
    """Bucket 1 found speculation four times slower per token; at bucket 4 the controller
    warms up plain decoding only, instead of paying a slow cycle per losing plan again."""
    one, four, eight = Plan(1), Plan(4), Plan(8)
    c = BlockController(candidates=(one, four, eight), warmup=2, explore_share=0.0)
    for _ in range(2):
        c.observe(1, one, 0.05, [])
        c.observe(1, four, 0.60, [(3, 0)])
        c.observe(1, eight, 0.90, [(7, 0)])
    picks = []
    for _ in range(6):
        p = c.choose(4)
        picks.append(p)
        c.observe(4, p, 0.06 if p == one else 0.8, [] if p == one else [(p.block - 1, 0)] * 4)
    assert picks == [one] * 6
    assert c.samples.get((4, four)) is None and c.samples.get((4, eight)) is None
    # the guess is scaled by plain decoding's cost at each bucket: 0.60 * 0.06 / 0.05
    assert abs(c.score(4, four) - 4 * expected_tokens(c.accept_rates(), 4) / 0.72) < 1e-9


def test_a_borrowed_estimate_close_to_the_best_is_still_measured():
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=2, explore_share=0.0)
    for _ in range(2):
        c.observe(1, one, 0.05, [])
        c.observe(1, four, 0.10, [(3, 3)])  # speculation wins at batch 1
    for _ in range(2):  # plain decoding, close enough to the borrowed best, is warmed up...
        assert c.choose(2) == one
        c.observe(2, one, 0.05, [])
    assert c.choose(2) == four  # ...and so is the borrowed winner


def test_score_without_any_estimate_is_a_clear_error():
    c = BlockController(candidates=(Plan(1),))
    with pytest.raises(KeyError, match="no estimate"):
        c.score(1, Plan(1))


def test_a_larger_block_that_cannot_win_is_not_warmed_up():
    """At a new bucket, block 4 loses clearly; blocks 8 and 16 would be slower still (more rows)
    and, at these acceptance rates, would not make up for it, so neither is sampled."""
    one, four, eight, sixteen = Plan(1), Plan(4), Plan(8), Plan(16)
    c = BlockController(candidates=(one, four, eight, sixteen), warmup=2, explore_share=0.0)
    picks = []
    for _ in range(8):
        p = c.choose(4)
        picks.append(p)
        seconds = 0.04 if p == one else 0.30 * p.block / 4
        c.observe(4, p, seconds, [] if p == one else [(p.block - 1, 1)] * 4)
    assert picks.count(four) == 1 and eight not in picks and sixteen not in picks
    assert c.score(4, eight) < c.dominated * c.score(4, one)  # an upper bound, from block 4's time


def test_a_larger_block_that_might_win_is_still_measured():
    one, four, eight = Plan(1), Plan(4), Plan(8)
    c = BlockController(candidates=(one, four, eight), warmup=1, explore_share=0.0)
    seen = set()
    for _ in range(5):
        p = c.choose(1)
        seen.add(p)
        c.observe(1, p, 0.05 if p == one else 0.06, [] if p == one else [(p.block - 1, p.block - 1)])
    assert seen == {one, four, eight}


def test_before_any_cycle_every_draft_reads_the_flat_prior():
    c = BlockController(candidates=(Plan(1), Plan(4)))
    assert c.accept_rates() == [0.5, 0.5, 0.5]  # one per draft of the largest block


def test_the_drafters_measured_rates_lead_until_traffic_outweighs_them():
    prior = (0.99, 0.6, 0.45)
    c = BlockController(candidates=(Plan(1), Plan(4)), prior=prior, prior_weight=8.0,
                        window=float("inf"))  # no fading: exact counts
    assert c.accept_rates() == pytest.approx(list(prior))
    for _ in range(8):  # real traffic accepts only the first draft
        c.observe(1, Plan(4), 0.1, [(3, 1)])
    rates = c.accept_rates()
    assert rates[0] == pytest.approx((8 + 8 * 0.99) / 16)
    assert rates[1] == pytest.approx((0 + 8 * 0.6) / 16)  # halfway to what traffic shows
    assert rates[2] == pytest.approx(0.45)  # never reached: the prior alone


def test_a_calibrated_time_counts_as_a_sample_but_teaches_no_acceptance():
    c = BlockController(candidates=(Plan(1), Plan(4)), warmup=1)
    c.observe_time(4, Plan(1), 0.04)
    c.observe_time(4, Plan(4), 0.20)
    assert c.samples == {(4, Plan(1)): 1, (4, Plan(4)): 1}
    assert c.accepted == [] and c.reached == []
    # both warmed up: the flat prior (1.875 tokens per row) cannot pay for 5x the time
    assert c.choose(4) == Plan(1)


def test_the_first_served_cycle_replaces_a_speculative_plans_calibrated_time():
    """Calibration times synthetic text with the fastest of a few cycles: a speculative plan
    reads fast, and averaging its first served cycles in kept choosing it at a loss."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), decay=0.8)
    c.seed_time(4, four, 0.140, 3)
    c.observe_time(4, four, 0.220)
    assert c.times[(4, four)] == pytest.approx(0.220)  # replaced, not 0.156
    c.observe_time(4, four, 0.200)
    assert c.times[(4, four)] == pytest.approx(0.8 * 0.220 + 0.2 * 0.200)  # averaged from now on


def test_plain_decodings_calibrated_time_gives_way_only_to_a_faster_served_step():
    one = Plan(1)
    c = BlockController(candidates=(one, Plan(4)), decay=0.8)
    c.seed_time(4, one, 0.067, 3)
    c.observe_time(4, one, 0.052)  # calibrated slow: the served step takes its place
    assert c.times[(4, one)] == pytest.approx(0.052)
    c.seed_time(8, one, 0.060, 3)
    c.observe_time(8, one, 0.090)  # one slow step only moves the average
    assert c.times[(8, one)] == pytest.approx(0.8 * 0.060 + 0.2 * 0.090)


def test_plain_decoding_is_served_once_per_bucket_before_its_calibrated_time_is_trusted():
    """Calibrated at twice its served cost, plain decoding would lose to speculation until
    re-measured: it runs first at each bucket, and its served step then decides."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), prior=(0.6, 0.3, 0.1), margin=0.0)
    for b in (1, 4):
        c.seed_time(b, one, 0.100, 3)  # served: 0.050
        c.seed_time(b, four, 0.120, 3)  # 1.96 tokens a row: ahead of the calibrated plain step
    assert c.choose(4) == one and c.choose(1) == one
    c.observe_time(4, one, 0.050)
    assert c.times[(4, one)] == pytest.approx(0.050) and c.choose(4) == one  # now it wins
    assert c.choose(1) == one  # bucket 1 has still not served one
    c.observe_time(1, one, 0.100)  # served as calibrated: speculation wins there
    assert c.choose(1) == four


def test_served_first_off_averages_calibrated_times_like_any_other():
    four = Plan(4)
    c = BlockController(candidates=(Plan(1), four), decay=0.8, served_first=False)
    c.seed_time(4, four, 0.140, 3)
    c.observe_time(4, four, 0.220)
    assert c.times[(4, four)] == pytest.approx(0.8 * 0.140 + 0.2 * 0.220)


def test_within_a_bucket_the_estimate_follows_the_actual_batch_size():
    assert along(0.1, 0.2, 2, 2) == 0.1 and along(0.1, 0.2, 2, 3) == pytest.approx(0.15)
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, prior=(1.0, 0.6, 0.47))
    for b, plain, spec in ((2, 0.040, 0.10), (4, 0.045, 0.20)):  # a CPU: spec rows are compute
        c.observe_time(b, one, plain)
        c.observe_time(b, four, spec)
    # 2.88 tokens per row: at batch 2 speculating wins (57.6 vs 50 tok/s) ...
    assert c.choose(2) == four
    # ... at batch 3 (same bucket) its cycle takes 0.15 s, not 0.10: plain wins (70.6 vs 57.6)
    assert c.choose(3) == one


def test_a_cycle_measured_above_the_buckets_size_is_stored_at_that_size():
    one = Plan(1)
    c = BlockController(candidates=(one, Plan(4)), decay=0.5)
    c.observe_time(2, one, 0.10)
    c.observe_time(4, one, 0.20)
    c.observe_time(3, one, 0.15)  # exactly the line between the two buckets
    assert c.times[(2, one)] == pytest.approx(0.10)


def test_a_cycle_between_two_buckets_moves_the_line_between_them_by_the_rate():
    from sglang_d3d.engine.adaptive import between_update

    for batch in (5, 6, 7):
        low, high = between_update(0.06, 0.09, 4, batch, 0.12, 0.2)
        before = along(0.06, 0.09, 4, batch)
        assert along(low, high, 4, batch) == pytest.approx(before + 0.2 * (0.12 - before))
        assert high - 0.09 > 0 and low - 0.06 > 0  # both ends up, the nearer one more
        assert (high - 0.09 > low - 0.06) == (batch > 6)


def test_an_upper_buckets_error_is_not_multiplied_into_the_lower_one():
    """Measured in a server: batch 8's plain step estimated 20 ms short, a load at 16 passing
    through 7 rows, and the plain step at 4 read 120 ms against 62 served; the server then
    speculated through two loads at concurrency 4. Cycles at 7 rows now move both ends."""
    one = Plan(1)
    c = BlockController(candidates=(one, Plan(4)), decay=0.8)
    c.observe_time(4, one, 0.062)
    c.observe_time(8, one, 0.085)  # the real step at 8 rows is 0.106
    for _ in range(300):
        c.observe_time(7, one, 0.062 + (0.106 - 0.062) * 3 / 4)  # served, on the true line
    assert c.times[(4, one)] < 0.070  # laying the miss on batch 4 alone: 0.062 + 3 x 0.021
    assert along(c.times[(4, one)], c.times[(8, one)], 4, 7) == pytest.approx(0.095, rel=1e-3)


def test_speculation_must_beat_plain_decoding_by_a_margin_to_be_chosen_and_half_to_stay():
    """The estimates leave costs of speculating out (catching up, held-back prefills, rates
    that lag the traffic), so near-ties go to plain decoding; a smaller margin to stay keeps
    the choice from flipping with every estimate's noise."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, explore_share=0.0, margin=0.1,
                        prior=(1.0, 0.5, 0.5))  # 2.75 tokens per cycle at block 4
    c.observe_time(1, one, 0.100)  # 10 tok/s
    c.observe_time(1, four, 0.330)  # 8.3 tok/s
    assert c.choose(1) == one
    c.times[(1, four)] = 0.260  # 10.6 tok/s: 6% better, not enough to leave plain decoding
    assert c.choose(1) == one
    c.times[(1, four)] = 0.230  # 12 tok/s: 20% better
    assert c.choose(1) == four
    c.times[(1, four)] = 0.255  # 10.8 tok/s: 8% better, enough to stay
    assert c.choose(1) == four
    c.times[(1, four)] = 0.270  # 10.2 tok/s: 2% better, dropped
    assert c.choose(1) == one


def test_one_slow_cycle_moves_the_estimate_by_a_bounded_step():
    four = Plan(4)
    c = BlockController(candidates=(Plan(1), four), decay=0.8, spike=2.0)
    c.observe_time(1, four, 0.080)
    c.observe_time(1, four, 0.400)  # a request's first cycle, prompt included
    assert c.times[(1, four)] == pytest.approx(0.8 * 0.080 + 0.2 * 0.160)
    for _ in range(20):  # a lasting change still comes through
        c.observe_time(1, four, 0.400)
    assert c.times[(1, four)] > 0.35


def test_acceptance_follows_the_traffic():
    """Rates are counts over about the last `window` row-cycles with drafts: after a long run
    of easy text, a run of hard text brings them down instead of being averaged away."""
    c = BlockController(candidates=(Plan(1), Plan(4)), window=200)
    for _ in range(2000):
        c.observe(1, Plan(4), 0.1, [(3, 3)])
    assert c.accept_rates()[0] > 0.99
    for _ in range(400):
        c.observe(1, Plan(4), 0.1, [(3, 0)])
    assert c.accept_rates()[0] < 0.15  # cumulative counts would still say 0.83
    reached = list(c.reached)
    c.observe(1, Plan(1), 0.05, [(0, 0)])  # plain decoding tests no draft: nothing fades
    assert c.reached == reached


def test_an_inflated_estimate_is_re_measured_as_it_grows_stale():
    """A run of slow cycles (long prompts, a noisy neighbour) can leave a winning plan's
    estimate looking like a loser's; its uncertainty grows while it goes unmeasured, so it is
    re-timed, and takes over again, sooner than its stale gap alone would allow."""
    def cycles_to_recover(drift: float) -> int:
        one, four = Plan(1), Plan(4)
        c = BlockController(candidates=(one, four), warmup=1, drift=drift)
        c.observe(1, one, 0.05, [])
        for _ in range(12):
            c.observe(1, four, 0.25, [(3, 3)])  # inflated: 16 tokens/s against plain's 20
        seconds, per_row = {one: 0.05, four: 0.09}, {one: [], four: [(3, 3)]}  # truly 44
        picks = _run(c, 5000, seconds, per_row)
        return next((i for i in range(len(picks)) if picks[i:i + 50].count(four) == 50),
                    len(picks))

    assert cycles_to_recover(0.02) < 0.6 * cycles_to_recover(0.0)


def test_a_plan_estimated_better_than_the_kept_one_is_re_measured():
    """Plain decoding kept through a near-tie (`margin`) must not leave the plan estimated
    better unmeasured: re-measuring it costs nothing, and its estimate then takes over."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, min_explore=1.0, drift=0.0)
    c.observe(1, one, 0.05, [])
    for _ in range(12):
        c.observe(1, four, 0.5, [(3, 3)])
    seconds, per_row = {one: 0.05, four: 0.09}, {one: [], four: [(3, 3)]}
    picks = _run(c, 3000, seconds, per_row)
    assert picks[-1000:].count(four) > 900


def test_a_request_starts_at_the_traffics_rates_and_moves_to_its_own():
    prior = [0.9, 0.6, 0.3]
    assert blend(AcceptCounts(), prior, 8.0) == prior  # no evidence yet
    own = AcceptCounts()
    for _ in range(8):
        own.add(3, 0)  # draft 1 rejected every time: drafts 2 and 3 never reached
    rates = blend(own, prior, 8.0)
    assert rates[0] == pytest.approx((0 + 8 * 0.9) / (8 + 8))  # its 8 cycles weigh as much as the prior
    assert rates[1:] == prior[1:]  # nothing reached there: the traffic's rates still
    assert own.reached == [8, 0, 0] and own.accepted == [0, 0, 0]


def test_rows_that_reject_their_drafts_decode_plainly_on_traffic_that_accepts():
    """The traffic's rates follow a change of prompt kind only over ~2000 row-cycles; the
    rows' own evidence moves the choice at once (chat served right after arithmetic)."""
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, explore_share=0.0)
    c.observe(4, one, 0.040, [])
    for _ in range(200):  # arithmetic: three drafts of three accepted
        c.observe(4, four, 0.080, [(3, 3)] * 4)
    assert c.choose(4) == four  # 16 tokens in 80 ms against 4 in 40
    chat = []
    for _ in range(4):
        e = AcceptCounts()
        for _ in range(40):  # draft 1 rate (0 + 8 * 1.0) / (40 + 8): 1.5 tokens a cycle
            e.add(3, 0)
        chat.append(e)
    assert c.choose(4, evidence=chat) == one
    # two of four rows still arithmetic-like: the batch is still worth speculating on
    sure = AcceptCounts()
    for _ in range(12):
        sure.add(3, 3)
    assert c.choose(4, evidence=[sure, sure, *chat[:2]]) == four
    assert c.choose(4, evidence=chat[:1]) == four  # the rows beyond the evidence: traffic rates


def test_one_curve_gives_every_blocks_expected_tokens():
    rates = [0.9, 0.6, 0.3]
    curve = expected_curve(rates, 6)
    assert len(curve) == 7
    for b in range(1, 7):  # past the known rates the last one repeats, as expected_tokens does
        assert curve[b] == pytest.approx(expected_tokens(rates, b))
    assert expected_curve([], 3)[1:] == [1.0, 1.0, 1.0]


def test_plans_verified_as_trees_are_scored_by_what_their_trees_yield():
    """A plan's trees that accept more than its chains would have raise its score by that
    ratio; trees that accept less (a deep block the tree does not reach) lower it; plans
    without trees keep the chain's estimate."""
    four, eight, four_o = Plan(4), Plan(8), Plan(4, True)
    c = BlockController(candidates=(Plan(1), four, eight, four_o), warmup=1)
    for p in (four, eight, four_o):
        c.observe(1, p, 0.08, [(p.block - 1, 2)])
    before = {p: c.score(1, p) for p in (four, eight, four_o)}
    assert c.tree_factor(four) == 1.0
    for _ in range(200):
        c.observe_trees(four, [(3, 2)])  # 4 tokens where the chain had 3
        c.observe_trees(eight, [(2, 3)])  # 3 where the chain of 7 had 4
    assert c.tree_factor(four) == pytest.approx(4 / 3, rel=0.02)
    assert c.tree_factor(eight) == pytest.approx(3 / 4, rel=0.02)
    assert c.score(1, four) == pytest.approx(before[four] * c.tree_factor(four))
    assert c.score(1, eight) == pytest.approx(before[eight] * c.tree_factor(eight))
    assert c.score(1, four_o) == before[four_o]
    snap = {p: tps for _, p, _, tps in c.snapshot()}
    assert snap[four] == pytest.approx(c.score(1, four))
    c.observe_trees(four, [])  # a cycle without trees teaches nothing
    assert c.tree_factor(four) == pytest.approx(4 / 3, rel=0.02)


def test_the_tree_factor_starts_at_the_chains_and_follows_the_traffic():
    c = BlockController(candidates=(Plan(1), Plan(4)), window=100)
    c.observe_trees(Plan(4), [(3, 2)])  # one cycle barely moves the prior
    assert 1.0 < c.tree_factor(Plan(4)) < 1.1
    for _ in range(500):
        c.observe_trees(Plan(4), [(3, 2)])
    for _ in range(500):
        c.observe_trees(Plan(4), [(2, 2)])  # trees now yield what chains do
    assert c.tree_factor(Plan(4)) == pytest.approx(1.0, abs=0.02)


def test_choose_says_how_fast_it_expects_its_plan_per_row():
    """What the engine weighs a cycle of copies against: nothing before any estimate, then
    the chosen plan's tokens a second per row (plain decoding at 0.10 s: 10)."""
    one = Plan(1)
    c = BlockController(candidates=(one,), warmup=1)
    c.choose(2)
    assert c.expected is None
    c.observe(2, one, 0.10, [(0, 0), (0, 0)])
    assert c.choose(2) == one and c.expected == pytest.approx(10.0)


def test_each_cycle_run_is_tallied_with_why_its_plan_was_chosen():
    one, four = Plan(1), Plan(4)
    c = BlockController(candidates=(one, four), warmup=1, explore_every=1, explore_share=1.0)
    for _ in range(2):  # each plan measured once: two warm-ups
        plan = c.choose(2)
        c.observe(2, plan, 0.1 if plan == one else 0.5, [(3, 0)] * 2 if plan == four else [])
    assert c.reasons() == [((2, one, WARMUP), 1), ((2, four, WARMUP), 1)]
    runs = []
    for _ in range(200):
        plan = c.choose(3)  # bucket 2
        runs.append((plan, c.reason))
        c.observe(3, plan, 0.1 if plan == one else 0.5, [(3, 0)] * 3 if plan == four else [])
    ran = dict(c.reasons())
    assert ran[(2, one, ESTIMATE)] == runs.count((one, ESTIMATE)) > 150  # plain wins
    assert ran[(2, four, EXPLORE)] == runs.count((four, EXPLORE)) >= 1  # re-measured in turn
    assert sum(ran.values()) == 202  # every cycle once, under the bucket it ran in


def test_kept_rates_and_curves_follow_every_change_of_evidence():
    """The rates, the traffic's curve and each row's curve are kept between cycles (a third of
    `choose` otherwise); after any mix of cycles with and without drafts tested, and rows'
    own counts moving, they equal what the counts give afresh."""
    import random

    rng = random.Random(0)
    c = BlockController(candidates=(Plan(1), Plan(4), Plan(8, True)), warmup=1,
                        prior=(0.8, 0.6, 0.5))
    rows = [AcceptCounts() for _ in range(3)]
    for _ in range(300):
        plan = c.choose(len(rows), None, rows)
        drafted = plan.block > 1 and rng.random() < 0.7
        per_row = [(plan.block - 1, rng.randrange(plan.block)) for _ in rows] if drafted else []
        c.observe(len(rows), plan, rng.uniform(0.01, 0.2), per_row)
        for e, t in zip(rows, per_row):
            e.add(*t)
        fresh = [c._rate(i) for i in range(max(7, len(c.reached)))]
        assert c.accept_rates() == fresh
        assert c._batch_tokens(fresh, rows, len(rows), 8) == pytest.approx(
            [sum(expected_curve(blend(e, fresh, c.row_weight), 8)[b] for e in rows if e.reached)
             + sum(not e.reached for e in rows) * expected_curve(fresh, 8)[b] for b in range(9)],
            rel=0, abs=0)
