"""engine/proposals.py: what a cycle verifies besides the plan, and the verify-budget rule for
copied guesses, alone."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_d3d.config import EngineConfig
from sglang_d3d.engine.proposals import Proposals

CFG = EngineConfig(draft_cutoff=0.1, tree_nodes=5, lookup_tokens=8, copy_ngram=2)


def test_served_settings_come_from_the_config_unless_drafting_is_fused():
    assert Proposals.of(CFG, separate_drafter=True) == Proposals(0.1, 5, 8, 2)
    assert Proposals.of(CFG, separate_drafter=False) == Proposals()


def test_calibration_verifies_whole_blocks_without_cycles_of_copies():
    served = Proposals.of(CFG, separate_drafter=True)
    calib = served.for_calibration()
    assert (calib.draft_cutoff, calib.copy_ngram) == (0.0, 0)
    assert (calib.tree_nodes, calib.lookup_tokens) == (5, 8)  # the plan's trees stay
    with pytest.raises(dataclasses.FrozenInstanceError):
        served.copy_ngram = 0  # type: ignore[misc]


@pytest.mark.parametrize(("batch", "beside", "want"), [
    (1, None, 8),  # 63 tokens of room: all 8
    (4, None, 8),  # 16 - 1 - 5 = 10
    (8, None, 2),  # 8 - 1 - 5
    (16, None, 0),  # 4 - 1 - 5 < 0: none
    (16, 0, 3),  # a cycle of copies: 4 - 1
])
def test_copies_take_what_the_verify_budget_leaves(batch, beside, want):
    p = Proposals.of(CFG, separate_drafter=True)
    assert p.lookup(batch, budget=64, beside=beside) == want


def test_no_copies_when_lookup_is_off():
    assert Proposals(tree_nodes=5).lookup(1, budget=64) == 0
