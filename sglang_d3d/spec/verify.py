"""Verification rules. Both keep the target's output exactly:

greedy: accept the longest prefix of drafts equal to the target's argmax; the target's argmax
        after it is the next token (a correction, or the bonus when every draft is accepted).
sampling: speculative rejection sampling. With p the target's (processed) distribution and q
        the drafter's at a position, accept draft x with probability min(1, p(x)/q(x)); on
        rejection draw from norm(max(p - q, 0)). Every emitted token is then distributed as p.
"""

from __future__ import annotations

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.spec.sampling import target_probs


def greedy_accept(
    draft: torch.Tensor,  # [G] draft token ids
    target_logits: torch.Tensor,  # [G+1, V]: position j scores the token after draft[:j]
) -> tuple[int, int]:
    """-> (number of drafts accepted, the target's next token)."""
    target = target_logits.argmax(-1)  # [G+1]
    matches = (draft == target[: draft.shape[0]]).int()
    n = int(matches.cumprod(0).sum().item())
    return n, int(target[n].item())


def rejection_accept(
    draft: torch.Tensor,  # [G] drafts, draft[j] ~ q[j]
    q: torch.Tensor,  # [G, V] drafter proposal distributions
    p: torch.Tensor,  # [G+1, V] target distributions (after temperature/top-k/top-p)
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """-> (number of drafts accepted, the next token drawn so the output follows p)."""
    g = draft.shape[0]
    u = torch.rand(g, generator=generator) if g else torch.empty(0)
    for j in range(g):
        x = int(draft[j])
        px, qx = float(p[j, x]), float(q[j, x])
        # q >= p: accept with probability p/q; q < p: always accept.
        if qx > 0 and float(u[j]) * qx < px:
            continue
        return j, _sample(residual(p[j], q[j]), generator)
    return g, _sample(p[g], generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [V]; falls back to p when q covers p everywhere (then rejection has
    probability zero, so this branch is only reached through float round-off)."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def verify_draft(
    draft: list[int],  # [G]
    q: torch.Tensor | None,  # [>=G, V] drafter distributions; None = drafts proposed surely
    logits: torch.Tensor,  # [G+1, V] the target's verify logits for this request
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """One request's verification under its sampling parameters (used by the embedded engine
    and the SGLang worker alike). -> (drafts accepted, the target's own next token)."""
    d = torch.tensor(draft, dtype=torch.long, device=logits.device)
    if params.greedy:
        return greedy_accept(d, logits)
    p = target_probs(logits, params).cpu()
    if q is None:
        # A placeholder draft is proposed with probability one: q is a point mass.
        q = torch.nn.functional.one_hot(d.cpu(), logits.shape[-1]).float()
    return rejection_accept(d.cpu(), q[: len(draft)].float().cpu(), p, generator)
