"""Cycles that verify runs copied from a request's own text with no drafter pass
(speculative/cycle.py `run_copy_cycle`, `EngineConfig.copy_ngram`)."""

from __future__ import annotations

import pytest
from conftest import layout_models, reference_greedy
from engine_helpers import make_engine

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate

# random tiny models fall into loops, so their answers repeat themselves: copies are found
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15], [70]]


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
def test_copy_cycles_keep_greedy_output_identical(request, layout, block, mode):
    models = layout_models(request, layout)
    eng = make_engine(models, mode, block=block, batch=2)  # 4 prompts, 2 slots: joins mid-way
    stats = _cycles(eng)
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=30))
    for prompt, o in zip(PROMPTS, out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 30)
    copied = [c for c in stats if c.copied]
    assert copied and len(copied) < len(stats)
    assert all(c.tree_nodes == 0 and c.num_accepted <= c.num_drafts <= 8 for c in copied)


def test_a_copy_cycle_runs_no_drafter_pass_and_teaches_the_controller_nothing(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, adaptive=True)
    stats, passes = _cycles(eng), _drafter_passes(eng)
    observed = []
    real = eng.controller.observe
    eng.controller.observe = lambda *a, **kw: (observed.append(a), real(*a, **kw))[1]
    out = generate(eng, PROMPTS[:1], SamplingParams(max_new_tokens=40))
    assert out[0].token_ids == reference_greedy(tiny_models[0], PROMPTS[0], 40)
    copied = sum(c.copied for c in stats)
    assert copied > 0
    assert len(observed) == len(stats) - copied  # the controller sees its plans' cycles only
    assert len(passes) <= len(stats) - copied  # at most one drafter pass per other cycle


def test_sampled_requests_copy_in_their_trees_only(tiny_models):
    """A sampled request takes copies in its trees (proposed surely, exact:
    tests/test_tree_sampling.py) but never in cycles of copies, and its tree grows by its own
    copy only: what it draws must not depend on its batch. Batched with a greedy request that
    copies, it gives what it gives alone."""
    from sglang_d3d.api import GenerationRequest

    sampled = SamplingParams(temperature=0.8, seed=1, max_new_tokens=40)
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=2)
    seen = []
    eng.cycle_listeners.append(lambda rid, c: seen.append((rid, c)))
    eng.submit_all([GenerationRequest("s", PROMPTS[0], sampled),
                    GenerationRequest("g", PROMPTS[0], SamplingParams(max_new_tokens=40))])
    together = {}
    while eng.has_work():
        for ev in eng.step():
            together.setdefault(ev.request_id, []).extend(ev.token_ids)
    mine = [c for rid, c in seen if rid == "s"]
    assert mine and not any(c.copied for c in mine)
    assert any(c.tree_nodes > eng.tree_nodes for c in mine)  # trees grown by its copies
    assert any(c.tree_nodes > eng.tree_nodes for rid, c in seen if rid == "g")
    alone = generate(make_engine(tiny_models, Mode.SYNC, block=4, batch=2), [PROMPTS[0]], sampled)
    assert together["s"] == alone[0].token_ids and len(alone[0].token_ids) == 40


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
