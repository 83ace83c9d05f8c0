"""Cycles that verify runs copied from a request's own text with no drafter pass
(speculative/cycle.py `run_copy_cycle`, `EngineConfig.copy_ngram`)."""

from __future__ import annotations

import pytest
from conftest import layout_models, reference_greedy
from engine_helpers import make_engine

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.cycle import COPIES, Plan

# random tiny models fall into loops, so their answers repeat themselves: copies are found
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15], [70]]


@pytest.mark.parametrize(("plan", "name"), [(Plan(1), "1"), (Plan(8), "8"),
                                            (Plan(8, overlap=True), "8o"), (COPIES, "copy")])
def test_a_plan_has_one_name_and_its_metrics_labels_give_it_back(plan, name):
    """Calibration tables, bench-serving's plan lists and the metrics' labels name a cycle of
    copies, and every plan, the same way (it was spelled out in three places)."""
    assert plan.name == name
    assert Plan.from_labels(plan.block_label, plan.overlap) == plan


def _cycles(eng) -> list:
    stats = []
    eng.cycle_listeners.append(lambda rid, c: stats.append(c))
    return stats


def _drafter_passes(eng) -> list[int]:
    """Rows in each drafter pass."""
    calls, real = [], eng.drafting.runner.run
    eng.drafting.runner.run = lambda packs, **kw: (calls.append(len(packs)), real(packs, **kw))[1]
    return calls


@pytest.mark.parametrize("layout,block", [("tiny", 4), ("production", 8)])
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
@pytest.mark.parametrize("guesses", [0, 8])
def test_copy_cycles_keep_greedy_output_identical(request, layout, block, mode, guesses):
    """With other texts' guesses beside the copy (earlier requests' text here: 4 prompts
    through 2 slots), a cycle of copies verifies a tree of them, at most 8 deep."""
    models = layout_models(request, layout)
    eng = make_engine(models, mode, block=block, batch=2, copy_guesses=guesses)  # joins mid-way
    stats = _cycles(eng)
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=30))
    for prompt, o in zip(PROMPTS, out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 30)
    copied = [c for c in stats if c.copied]
    assert copied and len(copied) < len(stats)
    assert all(c.num_accepted <= c.num_drafts <= 8 for c in copied)
    assert all(c.tree_nodes <= 64 // 2 - 1 for c in copied)  # the verify token budget's share
    assert any(c.tree_nodes for c in copied) == bool(guesses)


def test_a_copy_cycle_runs_no_drafter_pass_and_teaches_the_controller_nothing(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, adaptive=True)
    stats, passes = _cycles(eng), _drafter_passes(eng)
    observed, plans = [], []
    real = eng.controller.observe
    eng.controller.observe = lambda *a, **kw: (observed.append(a), real(*a, **kw))[1]
    made = []
    eng.plan_listeners.append(lambda batch, plan, seconds, tokens: (plans.append(plan), made.append(tokens)))
    out = generate(eng, PROMPTS[:1], SamplingParams(max_new_tokens=40))
    assert out[0].token_ids == reference_greedy(tiny_models[0], PROMPTS[0], 40)
    copied = sum(c.copied for c in stats)
    assert copied > 0
    assert len(observed) == len(stats) - copied  # the controller sees its plans' cycles only
    assert plans.count(COPIES) == copied and len(plans) == len(stats)  # the metrics see all
    # each cycle reports the tokens it made: every cycle's own, the first token is prefill's
    assert made == [c.accepted_length for c in stats]
    assert sum(made) >= len(out[0].token_ids) - 1
    assert len(passes) <= len(stats) - copied  # at most one drafter pass per other cycle


def _steps(eng, reqs) -> tuple[dict, dict]:
    """Run `reqs` together. -> ({request id: tokens}, {engine step: {request id: CycleStats}})."""
    by_step, out = {}, {}
    eng.cycle_listeners.append(lambda rid, c: by_step.setdefault(eng._steps, {}).__setitem__(rid, c))
    eng.submit_all(reqs)
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out, by_step


def test_sampled_requests_copy_alone_or_batched_and_draw_the_same(tiny_models):
    """A sampled request copies from its text: in cycles of copies alone, and, beside a
    request that drafts, on its own as a chain of sure nodes among the other's tree. Both
    verify it the same way, so what it draws does not depend on its batch: batched, each
    request gives what it gives alone."""
    loops = SamplingParams(temperature=0.8, seed=1, max_new_tokens=40)  # repeats itself
    wanders = SamplingParams(temperature=5.0, seed=2, max_new_tokens=40)  # rarely does
    reqs = [GenerationRequest("s", PROMPTS[0], loops), GenerationRequest("w", PROMPTS[2], wanders)]
    together, by_step = _steps(make_engine(tiny_models, Mode.SYNC, block=4, batch=2), reqs)
    mixed = [c for c in by_step.values() if len(c) == 2 and c["s"].copied and not c["w"].copied]
    assert mixed and all(c["s"].tree_nodes == c["w"].tree_nodes > 0 for c in mixed)  # one shape
    for req in reqs:
        alone, steps = _steps(make_engine(tiny_models, Mode.SYNC, block=4, batch=2), [req])
        assert together[req.request_id] == alone[req.request_id]
        assert len(alone[req.request_id]) == 40
        if req.request_id == "s":  # alone, its copies made cycles of copies
            assert any(c["s"].copied for c in steps.values())


def test_sampled_requests_copy_only_where_trees_are_on(tiny_models):
    """Without trees a sampled row's copy would be verified as a chain in a cycle of copies and
    not at all beside a drafted row: its draws would depend on its batch, so it never copies."""
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, tree_nodes=0)
    stats = _cycles(eng)
    out = generate(eng, PROMPTS[:1], SamplingParams(temperature=0.8, seed=1, max_new_tokens=40))
    assert len(out[0].token_ids) == 40 and stats and not any(c.copied for c in stats)


def test_copies_stay_within_the_verify_token_budget(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=4, verify_token_budget=16)
    stats = _cycles(eng)
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=30))
    for prompt, o in zip(PROMPTS, out):
        assert o.token_ids == reference_greedy(tiny_models[0], prompt, 30)
    copied = [c for c in stats if c.copied]
    assert copied and max(c.num_drafts for c in copied) <= 8  # 1 + 8 per row at batch 1 ...
    assert min(c.num_drafts for c in copied) <= 16 // 4 - 1  # ... 1 + 3 per row at batch 4


@pytest.mark.parametrize("setting", [{"copy_ngram": 0}, {"lookup_tokens": 0}])
def test_copies_can_be_turned_off(tiny_models, setting):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, **setting)
    stats = _cycles(eng)
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=30))
    for prompt, o in zip(PROMPTS, out):
        assert o.token_ids == reference_greedy(tiny_models[0], prompt, 30)
    assert stats and not any(c.copied for c in stats)
