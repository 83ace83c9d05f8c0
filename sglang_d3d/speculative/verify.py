"""Verification rules. Both keep the target's output exactly:

greedy: accept the longest prefix of drafts equal to the target's argmax; the target's argmax
        after it is the next token (a correction, or the bonus when every draft is accepted).
sampling: speculative rejection sampling. With p the target's (processed) distribution and q
        the drafter's at a position, accept draft x with probability min(1, p(x)/q(x)); on
        rejection draw from norm(max(p - q, 0)). Every emitted token is then distributed as p.

Everything here is tensor ops over a whole verify pass, on the logits' device: `verify_batch`
returns two [N] tensors (drafts accepted, next token), the only things the host needs. The
one-request functions (`greedy_accept`, `rejection_accept`, `verify_draft`) are the same maths
on a batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.sampling import RequestRandom, inverse_cdf, on_device, target_probs

Generator = RequestRandom | torch.Generator | None


# ---- the maths, batched -------------------------------------------------------------------------
def greedy_verify(
    drafts: torch.Tensor,  # [N, G] long
    logits: torch.Tensor,  # [N, G+1, V]: position j scores the token after drafts[:, :j]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (drafts accepted [N], the target's next token [N])."""
    target = logits.argmax(-1)  # [N, G+1]
    matches = (drafts == target[:, : drafts.shape[1]]).int()  # [N, G]
    n = matches.cumprod(-1).sum(-1)  # [N]: matches before the first mismatch
    return n, target.gather(1, n.unsqueeze(1)).squeeze(1)


def rejection_verify(
    drafts: torch.Tensor,  # [N, G] long, drafts[i, j] ~ q[i, j]
    q: torch.Tensor,  # [N, G, V] drafter proposal distributions
    p: torch.Tensor,  # [N, G+1, V] target distributions (after temperature/top-k/top-p)
    u: torch.Tensor,  # [N, G+1] uniforms in [0, 1): G acceptance tests, then the next token
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (drafts accepted [N], the next token [N] drawn so that the output follows p)."""
    g = drafts.shape[1]
    at = drafts.unsqueeze(-1)  # [N, G, 1]
    px = p[:, :g].gather(-1, at).squeeze(-1)  # [N, G]
    qx = q.gather(-1, at).squeeze(-1)  # [N, G]
    # q >= p: accept with probability p/q; q < p: always accept (u * q < p).
    accepted = (qx > 0) & (u[:, :g] * qx < px)  # [N, G]
    n = accepted.int().cumprod(-1).sum(-1)  # [N]: accepted before the first rejection
    return n, inverse_cdf(next_token_probs(p, q, n), u[:, g])


def next_token_probs(
    p: torch.Tensor,  # [N, G+1, V]
    q: torch.Tensor,  # [N, G, V]
    n: torch.Tensor,  # [N] drafts accepted
) -> torch.Tensor:
    """[N, V]: the residual norm(max(p_n - q_n, 0)) after a rejection at n < G; the target's
    own p_G after every draft was accepted."""
    g = q.shape[1]
    rows = torch.arange(n.shape[0], device=n.device)
    p_n = p[rows, n]  # [N, V]
    if g == 0:
        return p_n
    q_n = q[rows, n.clamp(max=g - 1)]  # [N, V]; unused where n == G
    return torch.where((n == g).unsqueeze(1), p_n, residual(p_n, q_n))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [..., V]; falls back to p where q covers p everywhere (rejection then
    has probability zero, so this is only reached through float round-off)."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


# ---- a verify pass --------------------------------------------------------------------------------
def verify_batch(
    drafts: torch.Tensor,  # [N, G] long, on the logits' device
    logits: torch.Tensor,  # [N, G+1, V] the target's verify logits
    params: Sequence[SamplingParams],  # [N]
    proposals: Sequence[torch.Tensor | None],  # [N] drafter probs [>=G, V]; None = point mass
    generators: Sequence[Generator],  # [N] per-request random streams (sampled rows)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request of a pass at once, each under its own sampling parameters.
    -> (drafts accepted [N], the target's own next token [N]), on the logits' device.

    A proposal of None means the drafts were proposed with probability one (a placeholder
    draft): verification against a point mass is still exact."""
    n, token = greedy_verify(drafts, logits)
    sampled = [i for i, sp in enumerate(params) if not sp.greedy]
    if not sampled:
        return n, token
    dev = logits.device
    rows = torch.tensor(sampled, device=dev)
    g, v = drafts.shape[1], logits.shape[-1]
    p = target_probs_rows(logits[rows], [params[i] for i in sampled])
    q = proposal_probs(drafts[rows], [proposals[i] for i in sampled], v)
    u = draw_uniforms([generators[i] for i in sampled], g + 1, dev)
    n_s, token_s = rejection_verify(drafts[rows], q, p, u)
    return n.index_copy(0, rows, n_s), token.index_copy(0, rows, token_s)


def target_probs_rows(
    logits: torch.Tensor,  # [N, T, V]
    params: Sequence[SamplingParams],  # [N]
) -> torch.Tensor:
    """[N, T, V] float32: `target_probs` per row, one call per distinct (temperature, top-k,
    top-p, min-p), so the batched path processes logits exactly as the one-request path does."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, sp in enumerate(params):
        groups.setdefault((sp.temperature, sp.top_k, sp.top_p, sp.min_p), []).append(i)
    for members in groups.values():
        rows = torch.tensor(members, device=logits.device)
        out[rows] = target_probs(logits[rows], params[members[0]])
    return out


def proposal_probs(
    drafts: torch.Tensor,  # [N, G]
    proposals: Sequence[torch.Tensor | None],  # [N] each [>=G, V] or None
    vocab: int,
) -> torch.Tensor:
    """[N, G, V] float32 on the drafts' device; a point mass on the draft where None."""
    n, g = drafts.shape
    q = torch.zeros(n, g, vocab, dtype=torch.float32, device=drafts.device)
    q.scatter_(-1, drafts.unsqueeze(-1), 1.0)
    for i, prop in enumerate(proposals):
        if prop is not None:
            q[i] = prop[:g].to(device=q.device, dtype=torch.float32)
    return q


def draw_uniforms(generators: Sequence[Generator], k: int, device: torch.device) -> torch.Tensor:
    """[N, k] uniforms, row i from request i's own stream (seeded requests stay reproducible
    whatever they are batched with)."""
    return torch.stack(
        [torch.rand(k, generator=on_device(g, device), device=device) for g in generators]
    )


# ---- one request ----------------------------------------------------------------------------------
def greedy_accept(
    draft: torch.Tensor,  # [G] draft token ids
    target_logits: torch.Tensor,  # [G+1, V]
) -> tuple[int, int]:
    """-> (number of drafts accepted, the target's next token)."""
    n, token = greedy_verify(draft.unsqueeze(0), target_logits.unsqueeze(0))
    return int(n[0]), int(token[0])


def rejection_accept(
    draft: torch.Tensor,  # [G] drafts, draft[j] ~ q[j]
    q: torch.Tensor,  # [G, V] drafter proposal distributions
    p: torch.Tensor,  # [G+1, V] target distributions (after temperature/top-k/top-p)
    generator: Generator,
) -> tuple[int, int]:
    """-> (number of drafts accepted, the next token drawn so the output follows p)."""
    u = draw_uniforms([generator], draft.shape[0] + 1, p.device)
    n, token = rejection_verify(draft.unsqueeze(0), q.unsqueeze(0), p.unsqueeze(0), u)
    return int(n[0]), int(token[0])


def verify_draft(
    draft: list[int],  # [G]
    q: torch.Tensor | None,  # [>=G, V] drafter distributions; None = drafts proposed surely
    logits: torch.Tensor,  # [G+1, V] the target's verify logits for this request
    params: SamplingParams,
    generator: Generator,
) -> tuple[int, int]:
    """One request's verification under its sampling parameters: `verify_batch` on a batch of
    one. -> (drafts accepted, the target's own next token)."""
    d = torch.tensor([draft], dtype=torch.long, device=logits.device).view(1, len(draft))
    n, token = verify_batch(d, logits.unsqueeze(0), [params], [q], [generator])
    accepted, nxt = torch.stack([n, token], 1)[0].tolist()
    return accepted, nxt
