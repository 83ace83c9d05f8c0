"""Pure-function tests of verification, rejection sampling and logits processing."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.sampling import target_probs
from sglang_d3d.speculative.verify import greedy_accept, rejection_accept, residual


def _onehot_logits(tokens: list[int], v: int = 8) -> torch.Tensor:
    out = torch.zeros(len(tokens), v)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


@pytest.mark.parametrize(
    "draft,target,expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus 4
        ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # rejected at 2: correction 5
        ([1, 2, 3], [6, 2, 3, 4], (0, 6)),  # first rejected; later matches do not count
        ([], [7], (0, 7)),  # no drafts: plain decoding
    ],
)
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(torch.tensor(draft, dtype=torch.long), _onehot_logits(target)) == expected


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, p), p)  # q covers p: falls back to p


def test_rejection_sampling_follows_target_distribution():
    """Two positions over a 4-token vocabulary; the target's second distribution depends on the
    first token. The emitted (x1, x2) pairs must follow p(x1) p(x2 | x1) whatever q is."""
    v, n = 4, 30000
    g = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.1, 0.4, 0.3, 0.2])
    p2 = torch.softmax(torch.randn(v, v, generator=g), -1)  # p2[x1] = p(x2 | x1)
    p3 = torch.full((v, v, v), 1.0 / v)
    q1 = torch.tensor([0.4, 0.1, 0.25, 0.25])
    q2 = torch.tensor([0.05, 0.05, 0.45, 0.45])  # context-free draft: deliberately poor
    counts = torch.zeros(v, v)
    for _ in range(n):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2, 1, generator=g))
        p = torch.stack([p1, p2[d1], p3[d1, d2]])
        k, tok = rejection_accept(torch.tensor([d1, d2]), torch.stack([q1, q2]), p, g)
        x = [d1, d2][:k] + [tok]
        if len(x) == 1:  # x2 would be drawn by the next cycle from p(. | x1)
            x.append(int(torch.multinomial(p2[x[0]], 1, generator=g)))
        counts[x[0], x[1]] += 1
    expected = (p1.unsqueeze(1) * p2) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 15 degrees of freedom: the 99.9% quantile is 37.7.
    assert chi2 < 37.7, chi2


def test_rejection_accepts_everything_when_q_equals_p():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    draft = torch.tensor([int(torch.multinomial(p[j], 1, generator=g)) for j in range(3)])
    k, _ = rejection_accept(draft, p[:3], p, g)
    assert k == 3


def test_greedy_params_give_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert torch.equal(target_probs(logits, SamplingParams()), torch.tensor([[0.0, 1.0, 0.0]]))


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    pk = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(pk, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    pp = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(pp, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))  # 0.5 < 0.7 needs 0.25 too
    p1 = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p1, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 0.0])
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(torch.tensor([0.5, 0.0]), -1))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=0)])
def test_sampling_params_validate(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_greedy_accept_exhaustive_small():
    """Every draft/target pair over a 2-token vocabulary, 3 drafts: n = longest agreeing prefix."""
    for draft in itertools.product(range(2), repeat=3):
        for target in itertools.product(range(2), repeat=4):
            n, tok = greedy_accept(torch.tensor(draft), _onehot_logits(list(target), 2))
            want = next((i for i in range(3) if draft[i] != target[i]), 3)
            assert (n, tok) == (want, target[want])


def test_extreme_but_legal_sampling_values_stay_finite():
    logits = torch.tensor([1.0, 3.0, 2.0])
    tiny_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert torch.equal(tiny_p, torch.tensor([0.0, 1.0, 0.0]))  # the top token always survives
    cold = SamplingParams(temperature=1e-300)
    assert cold.greedy and torch.equal(target_probs(logits, cold), torch.tensor([0.0, 1.0, 0.0]))


def test_usable_logits_need_a_finite_value_in_every_row():
    from sglang_d3d.speculative.sampling import usable

    ok = torch.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    assert usable(ok)
    assert not usable(torch.tensor([[float("nan"), float("nan")], [1.0, 2.0]]))
    assert not usable(torch.full((2, 3), float("-inf")))
