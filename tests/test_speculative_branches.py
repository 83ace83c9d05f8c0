"""Branch selection and matching (pure functions)."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.config import BranchPolicy
from sglang_d3d.speculative.branches import (
    Branch,
    enumerate_outcomes,
    match_branch,
    select_branches,
)


def _probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_outcome_scores_follow_drafter_confidence():
    # 2 drafts over a 3-token vocabulary; slot 3 is the bonus guess.
    draft = [0, 1]
    q = _probs([[0.9, 0.06, 0.04], [0.3, 0.5, 0.2], [0.1, 0.2, 0.7]])
    out = {(b.num_accepted, b.token): b.score for b in enumerate_outcomes(draft, q, guesses=1)}
    # n=0: correction = best token other than d1=0 -> 1, score q1(1)
    assert out[(0, 1)] == pytest.approx(0.06)
    # n=1: a1 * q2(best other than d2=1 -> 0)
    assert out[(1, 0)] == pytest.approx(0.9 * 0.3)
    # n=2 (all accepted): a1 * a2 * bonus guess q3(2)
    assert out[(2, 2)] == pytest.approx(0.9 * 0.5 * 0.7)
    assert len(out) == 3  # one guess for each of the G+1 outcomes


def test_scores_over_all_outcomes_and_tokens_sum_to_one():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(4, 5, generator=g), -1)
    draft = q[:3].argmax(-1).tolist()
    total = sum(b.score for b in enumerate_outcomes(draft, q, guesses=5))
    assert total == pytest.approx(1.0)


def test_guesses_never_repeat_the_rejected_draft():
    q = torch.softmax(torch.randn(3, 6), -1)
    draft = q[:2].argmax(-1).tolist()
    for b in enumerate_outcomes(draft, q, guesses=3):
        if b.num_accepted < len(draft):
            assert b.token != draft[b.num_accepted]


def test_select_topk_and_all():
    q = _probs([[0.9, 0.06, 0.04], [0.3, 0.5, 0.2], [0.1, 0.2, 0.7]])
    top = select_branches([0, 1], q, BranchPolicy.TOPK, budget=2, guesses=1)
    assert [(b.num_accepted, b.token) for b in top] == [(2, 2), (1, 0)]
    every = select_branches([0, 1], q, BranchPolicy.ALL, budget=1, guesses=2)
    assert len(every) == 6  # the budget does not cap ALL


def test_match_branch():
    bs = [Branch(2, 5, 0.5), Branch(0, 3, 0.2), Branch(1, 7, 0.1)]
    assert match_branch(bs, 0, 3) == 1
    assert match_branch(bs, 1, 7) == 2
    assert match_branch(bs, 1, 5) is None  # right length, wrong token: a miss
    assert match_branch([], 0, 0) is None
