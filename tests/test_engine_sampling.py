"""Sampling through the whole engine: seeded determinism and the target's distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import make_engine

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.spec.sampling import target_probs

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("mode", list(Mode))
def test_same_seed_same_output(tiny_models, mode):
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=20)
    a = generate(make_engine(tiny_models, mode), [PROMPT], p)[0].token_ids
    b = generate(make_engine(tiny_models, mode), [PROMPT], p)[0].token_ids
    assert a == b and len(a) == 20


def _exact_pair_distribution(hf, params: SamplingParams, vocab: int) -> torch.Tensor:
    """P(x1, x2) under the target alone, [V, V]."""
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1], params)
        ctx = torch.tensor([PROMPT + [x] for x in range(vocab)])
        p2 = target_probs(hf(ctx).logits[:, -1], params)
    return p1.unsqueeze(1) * p2


@pytest.mark.parametrize("mode", [Mode.ASYNC, Mode.SYNC])
def test_sampled_tokens_follow_the_target(tiny_models, mode):
    """The first token comes from prefill and the second from speculative verification; their
    joint distribution must be the target's (chi-square over the likely pairs)."""
    hf = tiny_models[0]
    params = SamplingParams(temperature=2.5, top_k=6, max_new_tokens=2)
    exact = _exact_pair_distribution(hf, params, 96)
    n = 1200
    eng = make_engine(tiny_models, mode, block=3, batch=8, max_queue=n)
    plist = [SamplingParams(temperature=2.5, top_k=6, max_new_tokens=2, seed=s) for s in range(n)]
    outs = generate(eng, [PROMPT] * n, plist)
    counts = torch.zeros(96, 96)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    expected = exact * n
    keep = expected >= 5  # the usual chi-square validity rule; the rest pooled
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(keep.sum())  # cells - 1, plus the pooled cell
    # A loose bound: mean dof, sd sqrt(2 dof); 5 sd is a one-in-millions false alarm.
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
    assert counts[~(exact > 0)].sum() == 0  # nothing outside top-k is ever emitted


def test_exhaustive_pairs_helper_is_a_distribution(tiny_models):
    d = _exact_pair_distribution(tiny_models[0], SamplingParams(temperature=1.0), 96)
    assert abs(float(d.sum()) - 1.0) < 1e-6
    assert all(float(d[i, j]) >= 0 for i, j in itertools.islice(itertools.product(range(96), repeat=2), 50))
