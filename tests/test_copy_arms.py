"""Whether cycles of copies verify other texts' guesses beside them, by measurement
(engine/copy_arms.py), alone and in the engine."""

from __future__ import annotations

import argparse

import pytest
from conftest import reference_greedy
from engine_helpers import make_engine

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig, verify_widths
from sglang_d3d.engine.copy_arms import ALONE, SHORT, WIDE, ArmsConfig, CopyArms, Rate
from sglang_d3d.engine.offline import generate

FAST, SLOW = (30, 1.0), (30, 2.0)  # (tokens, seconds) of one cycle


def _serve(arms: CopyArms, batch: int, cycles: int, on=FAST, off=SLOW) -> list:
    """`on`: what a cycle of the first way (wide, or alone) gives; `off`: of the short way."""
    chosen = []
    for _ in range(cycles):
        way = arms.choose(batch)
        arms.observe(batch, way, *(off if way.short else on))
        chosen.append(way)
    return chosen


def test_at_a_batch_of_one_the_whole_copy_alone_is_a_third_way():
    arms = CopyArms(cfg=ArmsConfig(probe=1, warmup=2, explore_every=4))
    assert arms.ways(1) == (WIDE, ALONE, SHORT) and arms.ways(2) == (WIDE, SHORT)
    alone_best = {WIDE: (30, 2.0), ALONE: (30, 1.0), SHORT: (30, 3.0)}
    chosen = []
    for _ in range(6 + 12):
        way = arms.choose(1)
        arms.observe(1, way, *alone_best[way])
        chosen.append(way)
    assert chosen[:6] == [WIDE, ALONE, SHORT] * 2  # each way's warm-up, in turn ...
    assert chosen[6:].count(ALONE) >= 10  # ... then the fastest, the others re-tried in turn
    assert set(_serve(CopyArms(), 2, 20)) == {WIDE, SHORT}  # above one: two ways
    assert CopyArms(cfg=ArmsConfig(alone_upto=0)).ways(1) == (WIDE, SHORT)


def test_both_ways_alternate_until_each_has_its_warmup():
    chosen = _serve(CopyArms(cfg=ArmsConfig(alone_upto=0, probe=1, warmup=3)), batch=1, cycles=6)
    assert chosen == [WIDE, SHORT] * 3


def _retries(chosen: list, leader) -> list[int]:
    return [i for i, c in enumerate(chosen) if c != leader]


@pytest.mark.parametrize("faster", [True, False])
def test_then_the_faster_way_serves_and_the_other_is_retried_ever_more_rarely(faster):
    """After its first `explore_every` cycles as leader the other way is re-tried, then after
    twice as many cycles each time, up to `max_interval`."""
    arms = CopyArms(cfg=ArmsConfig(alone_upto=0, warmup=2, explore_every=4, max_interval=8))
    on, off = (FAST, SLOW) if faster else (SLOW, FAST)
    after = _serve(arms, 1, 4 + 32, on, off)[4:]
    assert _retries(after, WIDE if faster else SHORT) == [4, 13, 22, 31]  # after 4, then 8 ...


def test_a_way_that_slows_down_loses_its_place():
    arms = CopyArms(cfg=ArmsConfig(alone_upto=0, warmup=2, explore_every=4, decay=0.5))
    _serve(arms, 1, 20)  # the wide way faster
    chosen = _serve(arms, 1, 40, on=(30, 4.0))  # then slower than the short copies
    assert chosen[-8:].count(SHORT) >= 7


def test_a_new_leader_is_retried_against_from_the_shortest_interval():
    arms = CopyArms(cfg=ArmsConfig(alone_upto=0, warmup=2, explore_every=4, max_interval=64))
    _serve(arms, 1, 4 + 40)  # the wide way leads; re-tries after 4, 8, 16 cycles, then 32
    assert arms.retries[1].interval == 32
    chosen = _serve(arms, 1, 60, on=(30, 8.0))  # now the short way is faster
    assert arms.retries[1].leader == SHORT and _retries(chosen[-30:], SHORT) != []


def test_batch_sizes_share_a_measure_by_bucket_and_rates_are_per_row():
    arms = CopyArms(cfg=ArmsConfig(alone_upto=0, warmup=2, explore_every=4))
    _serve(arms, 1, 20)  # at batch 1 the wide way is faster
    _serve(arms, 4, 10, on=SLOW, off=FAST)  # at 4 to 7 the short one
    _serve(arms, 6, 10, on=SLOW, off=FAST)
    assert arms.rate(1, WIDE).per_second > arms.rate(1, SHORT).per_second
    assert arms.rate(5, WIDE) is arms.rate(4, WIDE)
    assert arms.rate(4, WIDE).cycles + arms.rate(7, SHORT).cycles == 20
    assert _serve(arms, 1, 3)[1:] == [WIDE, WIDE] and _serve(arms, 5, 3)[1:] == [SHORT, SHORT]
    one = CopyArms()
    one.observe(4, WIDE, 40, 2.0)  # 4 rows, 10 tokens each in 2 s
    assert one.rate(4, WIDE).per_second == pytest.approx(5.0)


def _serve_against(arms: CopyArms, plan_rate: float, cycles: int, on=FAST, off=SLOW) -> list:
    chosen = []
    for _ in range(cycles):
        way = arms.choose(1, plan_rate)
        if way is not None:
            arms.observe(1, way, *(off if way.short else on))
        chosen.append(way)
    return chosen


def test_the_plan_runs_once_each_way_has_probed_where_the_controller_expects_more_of_it():
    """Copies at 30 tokens a second at best, the plan expected at 40: after each way's 2
    probing cycles the plan runs, and a way of copying is re-tried now and then, the faster
    first; where the plan is expected slower, copies go on to their full warm-up."""
    arms = CopyArms(cfg=ArmsConfig(alone_upto=0, probe=2, warmup=8, explore_every=4, max_interval=8))
    chosen = _serve_against(arms, 40.0, 4 + 23)
    assert chosen[:4] == [WIDE, SHORT, WIDE, SHORT]
    after = chosen[4:]
    assert _retries(after, None) == [4, 13, 22] and [after[i] for i in (4, 13)] == [WIDE, SHORT]
    slow_plan = _serve_against(CopyArms(cfg=ArmsConfig(alone_upto=0, probe=2, warmup=4)), 20.0, 12)
    assert slow_plan.count(None) == 0 and slow_plan[:8] == [WIDE, SHORT] * 4


def test_without_guesses_the_wide_way_is_the_whole_copy_alone():
    arms = CopyArms(guesses=False, cfg=ArmsConfig(warmup=2, explore_every=4))
    assert arms.ways(1) == (ALONE, SHORT) and set(_serve(arms, 1, 12)) == {ALONE, SHORT}
    assert not ALONE.guesses and not ALONE.short and WIDE.guesses and SHORT.short


def test_a_retry_that_beats_the_leader_runs_again_and_one_that_does_not_waits():
    """Re-tries against a plan expected at 40 tokens a second: the short way's re-try cycles
    run at 60, so each one is followed at once by another; the wide way's at 20 wait for the
    doubled interval."""
    arms = CopyArms(guesses=False, cfg=ArmsConfig(probe=1, warmup=8, explore_every=4, max_interval=64))
    rates = {ALONE: (20, 1.0), SHORT: (60, 1.0)}
    first = {ALONE: (10, 1.0), SHORT: (10, 1.0)}  # both probe slower than the plan
    chosen = []
    for _ in range(40):
        way = arms.choose(1, 40.0)
        chosen.append(way)
        if way is not None:
            arms.observe(1, way, *first.pop(way, rates[way]))
    assert chosen[:2] == [ALONE, SHORT] and chosen[2:6] == [None] * 4
    assert chosen[6] == ALONE and chosen[7:15] == [None] * 8  # slower: the interval doubles
    assert chosen[15] == SHORT and chosen[16] == SHORT  # faster: again at once ...
    assert None not in chosen[17:]  # ... until it leads (the other way then warms up)


def test_a_rate_weighs_recent_cycles_more():
    r = Rate()
    assert r.per_second == 0.0
    r.add(10, 1.0, decay=0.5)
    r.add(10, 3.0, decay=0.5)
    assert r.per_second == pytest.approx(15 / 3.5) and r.cycles == 2


@pytest.mark.parametrize("bad", [{"warmup": 0}, {"probe": 0}, {"probe": 9, "warmup": 8},
                                 {"explore_every": 1}, {"explore_every": 8, "max_interval": 4},
                                 {"decay": 0.0}, {"alone_upto": -1}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        ArmsConfig(**bad)


def test_a_negative_number_of_guesses_is_refused(capsys):
    with pytest.raises(ValueError, match="copy_guesses -1"):
        EngineConfig(copy_guesses=-1)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--copy-guesses", "-1"])
    assert "--copy-guesses" in capsys.readouterr().err
    assert engine_config(p.parse_args(["--copy-guesses", "3"])).copy_guesses == 3
    assert engine_config(p.parse_args([])).copy_guesses is None  # the engine sets it


def test_verify_widths_follow_what_verify_width_costs():
    assert verify_widths(None, None, None, rows_apart=False) == (8, 8, 5)
    assert verify_widths(None, None, None, rows_apart=True) == (4, 0, 0)
    assert verify_widths(6, None, 3, rows_apart=True) == (6, 0, 3)
    assert verify_widths(0, 3, None, rows_apart=False) == (0, 3, 5)
    cfg = EngineConfig(lookup_tokens=2).with_verify_widths(rows_apart=False)
    assert (cfg.lookup_tokens, cfg.copy_guesses) == (2, 8)


def test_a_fixed_plans_block_follows_what_verify_width_costs():
    """Without the adaptive controller: the whole block where verify rows share a pass, 4
    where they run apart; an explicit block stands, capped by the drafter's block."""
    assert EngineConfig().with_verify_widths(rows_apart=False).fixed_block == 16
    assert EngineConfig().with_verify_widths(rows_apart=True).fixed_block == 4
    assert EngineConfig(fixed_block=8).with_verify_widths(rows_apart=True).fixed_block == 8
    small = EngineConfig(spec=SpecConfig(block_size=3))
    assert small.with_verify_widths(rows_apart=True).fixed_block == 3
    assert EngineConfig(fixed_block=32).with_verify_widths(rows_apart=False).fixed_block == 16
    with pytest.raises(ValueError, match="fixed_block must be >= 2"):
        EngineConfig(fixed_block=1)


def test_the_engine_tries_both_ways_and_keeps_the_targets_output(tiny_models):
    """Greedy requests that repeat themselves (random tiny models loop) make many cycles of
    copies: both ways run, trees with guesses and chains alone, and outputs stay the target's."""
    prompts = [[5, 6, 7, 5, 6, 7, 5], [12, 40, 13, 50, 14, 60, 15]]
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1)
    eng.copy_arms = CopyArms(cfg=ArmsConfig(alone_upto=0))  # as at batches above one
    stats = []
    eng.cycle_listeners.append(lambda rid, c: stats.append(c))
    out = generate(eng, prompts, SamplingParams(max_new_tokens=60))
    for p, o in zip(prompts, out):
        assert o.token_ids == reference_greedy(tiny_models[0], p, 60)
    assert eng.copy_arms.rate(1, WIDE).cycles and eng.copy_arms.rate(1, SHORT).cycles
    copied = [c for c in stats if c.copied]
    assert any(c.tree_nodes for c in copied) and any(not c.tree_nodes for c in copied)
    short = eng.cfg.lookup_tokens // 2  # the short way's copies: half the length, as chains
    assert all(c.num_drafts <= short for c in copied if not c.tree_nodes)
    assert any(c.num_drafts > short for c in copied if c.tree_nodes)


def test_the_engine_runs_all_three_ways_at_a_batch_of_one(tiny_models):
    prompts = [[5, 6, 7, 5, 6, 7, 5], [12, 40, 13, 50, 14, 60, 15]]
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1)
    out = generate(eng, prompts, SamplingParams(max_new_tokens=60))
    for p, o in zip(prompts, out):
        assert o.token_ids == reference_greedy(tiny_models[0], p, 60)
    assert all(eng.copy_arms.rate(1, w).cycles for w in (WIDE, ALONE, SHORT))


def test_no_guesses_or_no_copies(tiny_models):
    assert make_engine(tiny_models, Mode.SYNC, copy_guesses=0).copy_arms.ways(1) == (ALONE, SHORT)
    assert make_engine(tiny_models, Mode.SYNC, copy_ngram=0).copy_arms is None
    assert make_engine(tiny_models, Mode.AR).copy_arms is None


def test_the_engine_runs_its_plan_where_copies_measured_slower(tiny_models):
    """Once copies have measured slower than the controller expects its plan to be, cycles
    whose rows all found copies mostly run the plan; outputs stay the target's."""
    prompt = [5, 6, 7, 5, 6, 7, 5]
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, adaptive=True)
    eng.copy_arms = CopyArms(cfg=ArmsConfig(alone_upto=0, warmup=2, explore_every=4))
    real_plan = eng.controller.choose

    def plan_expected_fast(*a, **kw):  # the plan expected faster than anything
        chosen = real_plan(*a, **kw)
        eng.controller.expected = 1e9
        return chosen

    eng.controller.choose = plan_expected_fast
    stats, ways, real = [], [], eng.copy_arms.choose
    eng.cycle_listeners.append(lambda rid, c: stats.append(c))
    eng.copy_arms.choose = lambda *a: (ways.append(real(*a)), ways[-1])[1]
    out = generate(eng, [prompt], SamplingParams(max_new_tokens=60))
    assert out[0].token_ids == reference_greedy(tiny_models[0], prompt, 60)
    assert ways[:4] == [WIDE, SHORT, WIDE, SHORT]  # both ways of copying measured first ...
    assert len(ways) >= 8 and ways[4:].count(None) >= 3 * len(ways[4:]) // 4  # ... then the plan
    assert sum(c.copied for c in stats) == len(ways) - ways.count(None)


def test_copies_that_start_slow_lead_within_twenty_cycles_where_they_pay():
    """The first cycles of each way of copying measured slowest (MBPP on the 4-bit CPU path:
    22.6 and 18.1 ms copying whole, 17.0 and 16.1 ms copying half, then about 16 and 11 ms),
    below the plan's 115 tokens a second; later cycles pay (120 and 150). The plan leads
    first; its first re-try runs faster than the plan, so it runs again at once, and copies
    lead within twenty cycles (with re-tries only at doubling intervals: the 62nd)."""
    arms = CopyArms(guesses=False)
    first = [(1, 0.0226), (2, 0.017), (1, 0.0181), (1, 0.0161)]
    chosen = []
    for _ in range(300):
        way = arms.choose(1, 115.0)
        chosen.append(way)
        if way is not None:
            ran = sum(c is not None for c in chosen)
            arms.observe(1, way, *(first[ran - 1] if ran <= len(first)
                                   else (2.0, 0.0133) if way.short else (1.6, 0.0133)))
    assert None in chosen[:20]  # the plan led after the slow start
    lead = next(i for i in range(len(chosen)) if None not in chosen[i:i + 30])
    assert lead < 20 and chosen[-50:].count(SHORT) >= 45
