"""Which verification outcomes to pre-draft for, and which pre-drafted branch an outcome hits.

While the target verifies drafts d1..dG, the drafter pre-drafts the next block for a few
hypotheses (n, t): "the target accepts n drafts and then emits token t". For n < G, t is a
correction (t != d_{n+1}); for n == G, t is the bonus token. The drafter scores hypotheses with
its own slot distributions: with a_j = q_j(d_j),

    P(n)       = a_1 ... a_n (1 - a_{n+1})        (n < G),   P(G) = a_1 ... a_G
    P(t | n)   = q_{n+1}(t) / (1 - a_{n+1})        (n < G),   P(t | G) = q_{G+1}(t)

where q_{G+1} is the drafter's last mask slot: its guess at the bonus position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.config import BranchPolicy
from sglang_d3d.speculative.draft_length import draft_confidences


@dataclass(frozen=True)
class Branch:
    num_accepted: int  # hypothesis: drafts the target accepts
    token: int  # hypothesis: the target's own next token
    score: float  # the drafter's probability of this outcome


def enumerate_outcomes(
    draft: list[int],  # [G]
    slot_probs: torch.Tensor,  # [G+1, V] drafter probabilities for slots 1..G+1
    guesses: int,
) -> list[Branch]:
    """Every outcome (n = 0..G) with up to `guesses` token guesses each, best first per n."""
    g = len(draft)
    top_p, top_i = slot_probs.float().topk(min(guesses + 1, slot_probs.shape[-1]), dim=-1)
    top_p, top_i = top_p.tolist(), top_i.tolist()
    keep = draft_confidences(draft, slot_probs)  # a_j = q_j(d_j)
    out: list[Branch] = []
    prefix = 1.0  # a_1 ... a_n
    for n in range(g + 1):
        # P(n) * P(t | n) = prefix * q_{n+1}(t): the (1 - a_{n+1}) factors cancel.
        excluded = draft[n] if n < g else None
        cands = [(t, p) for t, p in zip(top_i[n], top_p[n]) if t != excluded][:guesses]
        out.extend(Branch(n, t, prefix * p) for t, p in cands)
        if n < g:
            prefix *= keep[n]
    return out


def select_branches(
    draft: list[int],
    slot_probs: torch.Tensor,  # [G+1, V]
    policy: BranchPolicy,
    budget: int,
    guesses: int,
) -> list[Branch]:
    """ALL: every outcome (G+1 of them, times guesses). TOPK: the `budget` most likely."""
    outcomes = enumerate_outcomes(draft, slot_probs, guesses)
    if policy is BranchPolicy.ALL:
        return outcomes
    return sorted(outcomes, key=lambda b: -b.score)[:budget]


def match_branch(branches: list[Branch], num_accepted: int, token: int) -> int | None:
    """Index of the branch whose hypothesis equals the verified outcome, or None (a miss)."""
    for i, b in enumerate(branches):
        if b.num_accepted == num_accepted and b.token == token:
            return i
    return None
