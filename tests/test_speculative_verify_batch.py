"""Batched on-device verification (speculative/verify.py) against the per-row rules it replaced.

The per-row functions below are the pre-batch implementation (a Python loop per request), kept
here as the executable specification. The existing exactness and chi-square tests
(test_speculative_verify.py, test_engine_sampling.py) run unchanged against the batched code, since the
one-request functions are now the batched ones on a batch of one.
"""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.sampling import RequestRandom, target_probs
from sglang_d3d.speculative.verify import (
    greedy_verify,
    inverse_cdf,
    next_token_probs,
    rejection_verify,
    residual,
    verify_batch,
)


# ---- the per-row reference ------------------------------------------------------------------------
def rowwise_greedy(draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    target = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


def rowwise_rejection(draft: list[int], q: torch.Tensor, p: torch.Tensor, u: torch.Tensor):
    """-> (accepted, the distribution the next token is drawn from [V])."""
    for j, x in enumerate(draft):
        px, qx = float(p[j, x]), float(q[j, x])
        if qx > 0 and float(u[j]) * qx < px:
            continue
        return j, residual(p[j], q[j])
    return len(draft), p[len(draft)]


def _random_case(n: int, g: int, v: int, seed: int, agree: float = 0.7):
    """Drafts that agree with the target's argmax for a random prefix length."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g + 1, v, generator=gen, dtype=torch.float64) * 3
    drafts = logits[:, :g].argmax(-1)
    flip = torch.rand(n, g, generator=gen) > agree
    drafts = torch.where(flip, torch.randint(0, v, (n, g), generator=gen), drafts)
    return drafts, logits


# ---- greedy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [0, 1, 7])
def test_greedy_verify_equals_the_rowwise_rule(g):
    drafts, logits = _random_case(64, g, 50, seed=g)
    n, tok = greedy_verify(drafts, logits)
    want = [rowwise_greedy(drafts[i].tolist(), logits[i]) for i in range(64)]
    assert list(zip(n.tolist(), tok.tolist())) == want
    assert len(set(n.tolist())) > 1 or g == 0  # the case covers several accept lengths


# ---- rejection sampling ---------------------------------------------------------------------------
def test_rejection_verify_accepts_as_the_rowwise_rule_and_draws_from_its_distribution():
    n_rows, g, v = 200, 5, 12
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(n_rows, g + 1, v, generator=gen) * 2, -1)
    noise = torch.softmax(torch.randn(n_rows, g, v, generator=gen) * 2, -1)
    q = 0.6 * p[:, :g] + 0.4 * noise  # close enough to p that every accept length occurs
    q[::7] = p[::7, :g]  # rows where q == p: every draft accepted
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(n_rows, g)
    u = torch.rand(n_rows, g + 1, generator=gen)
    n, tok = rejection_verify(drafts, q, p, u)
    dist = next_token_probs(p, q, n)
    for i in range(n_rows):
        k, want = rowwise_rejection(drafts[i].tolist(), q[i], p[i], u[i])
        assert int(n[i]) == k
        assert torch.allclose(dist[i], want)
        assert float(want[tok[i]]) > 0  # the drawn token is possible under that distribution
    assert {0, g} <= set(n.tolist())  # both ends: first rejected, all accepted


def test_batched_rejection_sampling_follows_the_target_in_one_call():
    """The chi-square of test_speculative_verify.py, as one batched call of 30000 rows."""
    v, rows = 4, 30000
    g = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.1, 0.4, 0.3, 0.2])
    p2 = torch.softmax(torch.randn(v, v, generator=g), -1)  # p2[x1] = p(x2 | x1)
    q = torch.tensor([[0.4, 0.1, 0.25, 0.25], [0.05, 0.05, 0.45, 0.45]]).expand(rows, 2, v)
    d = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(rows, 2)
    p = torch.stack([p1.expand(rows, v), p2[d[:, 0]], torch.full((rows, v), 1.0 / v)], 1)
    n, tok = rejection_verify(d, q.contiguous(), p, torch.rand(rows, 3, generator=g))
    x1 = torch.where(n >= 1, d[:, 0], tok)
    x2_next = torch.multinomial(p2[x1], 1, generator=g).squeeze(1)  # the next cycle's token
    x2 = torch.where(n >= 2, d[:, 1], torch.where(n == 1, tok, x2_next))
    counts = torch.zeros(v, v).index_put_((x1, x2), torch.ones(rows), accumulate=True)
    expected = (p1.unsqueeze(1) * p2) * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, chi2  # 15 degrees of freedom, 99.9% quantile


def test_inverse_cdf_follows_the_distribution_and_never_draws_impossible_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    rows = 20000
    u = torch.rand(rows, generator=torch.Generator().manual_seed(1))
    draws = inverse_cdf(probs.expand(rows, -1), u)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    exp = probs.double() * rows
    keep = exp > 0
    chi2 = float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < 13.8, chi2  # 2 degrees of freedom, 99.9% quantile
    edge = inverse_cdf(probs.view(1, -1), torch.tensor([1.0 - 2**-24]))  # u at its top
    assert int(edge) == 4  # the last token with mass, not the zero-probability tail


# ---- a whole verify pass ----------------------------------------------------------------------------
def test_verify_batch_equals_per_request_verification_under_mixed_parameters():
    """Greedy rows, two sampling settings, real and placeholder proposals, in one batch."""
    g, v = 4, 40
    drafts, logits = _random_case(12, g, v, seed=5, agree=0.8)
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0
        else SamplingParams(temperature=0.7, top_k=10) if i % 3 == 1
        else SamplingParams(temperature=1.3, top_p=0.8)
        for i in range(12)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    proposals = [
        None if i % 4 == 3 else torch.softmax(torch.randn(g + 1, v, generator=gen), -1)
        for i in range(12)
    ]
    n, tok = verify_batch(drafts, logits, params, proposals, [RequestRandom(i) for i in range(12)])
    for i, sp in enumerate(params):
        d = drafts[i].tolist()
        if sp.greedy:
            assert (int(n[i]), int(tok[i])) == rowwise_greedy(d, logits[i])
            continue
        p = target_probs(logits[i], sp)
        q = proposals[i][:g] if proposals[i] is not None else torch.eye(v)[drafts[i]]
        u = torch.rand(g + 1, generator=RequestRandom(i).on("cpu"))  # row i's own stream
        k, dist = rowwise_rejection(d, q, p, u)
        assert int(n[i]) == k
        assert int(tok[i]) == int(inverse_cdf(dist.view(1, -1), u[g:]))


def test_seeded_rows_do_not_depend_on_their_batch():
    drafts, logits = _random_case(6, 3, 30, seed=2)
    sp = [SamplingParams(temperature=1.0)] * 6
    full = verify_batch(drafts, logits, sp, [None] * 6, [RequestRandom(i) for i in range(6)])
    alone = verify_batch(drafts[4:5], logits[4:5], sp[:1], [None], [RequestRandom(4)])
    assert (int(full[0][4]), int(full[1][4])) == (int(alone[0][0]), int(alone[1][0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_batch_runs_on_the_gpu_and_agrees_with_the_cpu():
    g, v = 7, 1000
    drafts, logits = _random_case(16, g, v, seed=11)
    params = [SamplingParams(temperature=0.0)] * 8 + [SamplingParams(temperature=0.9)] * 8
    q = torch.softmax(torch.randn(16, g + 1, v, dtype=torch.float64), -1)
    gens = [RequestRandom(i) for i in range(16)]
    n, tok = verify_batch(drafts.cuda(), logits.cuda(), params, list(q.cuda()), gens)
    assert n.device.type == "cuda" and tok.device.type == "cuda"
    cpu_n, cpu_tok = greedy_verify(drafts[:8], logits[:8])
    assert n[:8].tolist() == cpu_n.tolist() and tok[:8].tolist() == cpu_tok.tolist()
    p = target_probs(logits[8:], params[8]).cuda()
    u = torch.rand(8, g + 1, device="cuda")
    n_gpu, _ = rejection_verify(drafts[8:].cuda(), q[8:, :g].float().cuda(), p, u)
    n_cpu, _ = rejection_verify(drafts[8:], q[8:, :g].float(), p.cpu(), u.cpu())
    assert n_gpu.tolist() == n_cpu.tolist()
