"""The plan per load (sglang_worker/load_plan.py): each batch-size bucket tries both kinds of
cycle, then runs the faster one, and keeps re-trying the other. No sglang needed."""

from __future__ import annotations

from sglang_d3d.sglang_worker.load_plan import FUSED, PLAIN, SPEC, LoadPlan, bucket


def run(plan: LoadPlan, batch: int, rates: dict[str, float], cycles: int) -> list[str]:
    kinds = []
    for _ in range(cycles):
        kind = plan.choose(batch)
        plan.record(batch, kind, tokens=rates[kind], seconds=1.0)
        kinds.append(kind)
    return kinds


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_it_tries_both_then_keeps_the_faster():
    plan = LoadPlan(probe=3, explore_every=1000)
    kinds = run(plan, 1, {SPEC: 2.5, PLAIN: 1.0}, 40)
    assert kinds[:6].count(SPEC) == 3 and kinds[:6].count(PLAIN) == 3
    assert set(kinds[6:]) == {SPEC}
    kinds = run(LoadPlan(probe=3, explore_every=1000), 8, {SPEC: 6.0, PLAIN: 8.0}, 40)
    assert set(kinds[6:]) == {PLAIN}


def test_batch_sizes_are_planned_apart():
    plan = LoadPlan(probe=2, explore_every=1000)
    run(plan, 1, {SPEC: 3.0, PLAIN: 1.0}, 20)
    run(plan, 8, {SPEC: 4.0, PLAIN: 8.0}, 20)
    assert plan.choose(1) == SPEC and plan.choose(8) == PLAIN


def test_it_re_tries_the_slower_kind_and_follows_a_change():
    plan = LoadPlan(probe=2, explore_every=16, decay=0.5)
    kinds = run(plan, 4, {SPEC: 3.0, PLAIN: 1.0}, 64)
    assert PLAIN in kinds[20:]  # explored again
    kinds = run(plan, 4, {SPEC: 0.5, PLAIN: 1.0}, 64)  # speculation stopped paying
    assert kinds[-32:].count(PLAIN) >= 28  # plain, but for the re-tries


def test_three_kinds_each_probed_the_best_kept_the_others_re_tried_in_turn():
    plan = LoadPlan(probe=2, explore_every=8, kinds=(SPEC, FUSED, PLAIN))
    kinds = run(plan, 1, {SPEC: 2.0, FUSED: 3.0, PLAIN: 1.0}, 80)
    assert kinds[:6] == [SPEC, SPEC, FUSED, FUSED, PLAIN, PLAIN]
    later = kinds[6:]
    assert later.count(FUSED) > 0.7 * len(later)
    assert SPEC in later and PLAIN in later  # both re-tried


def test_a_kind_outside_the_plan_is_not_recorded():
    plan = LoadPlan(kinds=(SPEC, PLAIN))
    plan.record(1, FUSED, tokens=9, seconds=1.0)
    assert set(plan.summary()[1]) == {SPEC, PLAIN}
