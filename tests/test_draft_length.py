"""Verifying only the drafts the drafter is sure of (speculative/draft_length.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import layout_models, reference_greedy
from engine_helpers import make_engine

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.calibrate import calibrate
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.cycle import Plan
from sglang_d3d.speculative.draft_length import (
    batch_length,
    confident_length,
    draft_confidences,
    row_confidences,
)

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def test_leading_drafts_are_kept_while_the_running_product_holds():
    assert confident_length([0.9, 0.5, 0.3, 0.99], 0.2) == 2  # 0.9, 0.45, then 0.135
    assert confident_length([0.9, 0.5, 0.3], 0.1) == 3
    assert confident_length([0.9, 0.5, 0.3], 0.0) == 3  # no cutoff: the whole block


def test_draft_one_is_always_kept_and_no_draft_gives_none():
    assert confident_length([0.01, 0.99], 0.5) == 1
    assert confident_length([], 0.5) == 0


def test_confidences_are_the_drafter_probabilities_of_its_own_drafts():
    q = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4]])  # [G+1, V]
    assert draft_confidences([1, 2], q) == pytest.approx([0.7, 0.25])
    assert draft_confidences([], q) == []


def test_a_sampled_rows_confidences_do_not_look_at_its_draws():
    """Sampled drafts are draws: cutting on their own probabilities would verify a draft only
    for some draws (not exact), so a sampled row's confidence is each slot's top probability,
    the same whatever was drawn."""
    q = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4]])
    assert row_confidences([1, 2], q, greedy=True) == pytest.approx([0.7, 0.25])
    for draft in ([1, 2], [0, 0], [2, 1]):
        assert row_confidences(draft, q, greedy=False) == pytest.approx([0.7, 0.5])
    assert row_confidences([], q, greedy=False) == []


def test_one_block_length_per_pass_the_longest_asked():
    assert batch_length([1, 3, 2], 7) == 3
    assert batch_length([None, 2], 7) == 2  # a placeholder row asks for nothing
    assert batch_length([None, None], 7) == 7


def test_the_cutoff_is_a_probability():
    with pytest.raises(ValueError, match="draft_cutoff"):
        EngineConfig(draft_cutoff=1.0)
    with pytest.raises(ValueError, match="draft_cutoff"):
        EngineConfig(draft_cutoff=-0.1)


@pytest.mark.parametrize("layout,block", [("tiny", 5), ("production", 8)])
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_cut_blocks_keep_greedy_output_identical_and_verify_fewer_drafts(request, layout, block, mode):
    models = layout_models(request, layout)
    cycles = []
    # lookup_tokens 0: the drafter's blocks, cut (copies from the text are never cut)
    eng = make_engine(models, mode, block=block, draft_cutoff=0.9, lookup_tokens=0)
    eng.cycle_listeners.append(lambda rid, c: cycles.append(c.num_drafts))
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, o in zip(PROMPTS, out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 24)
    # a random drafter is unsure: most blocks are cut, none below one draft
    assert min(cycles) >= 1 and sum(n < block - 1 for n in cycles) > len(cycles) // 2


def test_cut_blocks_under_sampling_complete(request):
    models = layout_models(request, "production")
    eng = make_engine(models, Mode.ASYNC, block=8, draft_cutoff=0.5)
    out = generate(eng, PROMPTS, SamplingParams(temperature=0.8, seed=2, max_new_tokens=20))
    assert all(o.error is None and len(o.token_ids) == 20 for o in out)


def test_the_controller_counts_drafts_cut_as_rejected(tiny_models):
    """Its expected tokens per cycle are of the plan as run: a block of 5 cut to 1 draft
    that was accepted yields 2 tokens, as a whole block rejected at draft 2 would."""
    eng = make_engine(tiny_models, Mode.SYNC, block=5, adaptive=True, draft_cutoff=0.9)
    whole = make_engine(tiny_models, Mode.SYNC, block=5, adaptive=True)

    one = SimpleNamespace(stats=SimpleNamespace(num_drafts=1, num_accepted=1), chain=None)  # an Outcome's
    assert eng._tested(Plan(5), [one]) == [(4, 1)]
    assert whole._tested(Plan(5), [one]) == [(1, 1)]


def test_calibration_times_whole_blocks_and_restores_the_cutoff(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, adaptive=True, draft_cutoff=0.9)
    seen, real = [], eng.drafting.cut
    eng.drafting.cut = lambda rows, cutoff: (seen.append(cutoff), real(rows, cutoff))
    calibrate(eng)
    assert seen and set(seen) == {0.0} and eng.proposals.draft_cutoff == 0.9
