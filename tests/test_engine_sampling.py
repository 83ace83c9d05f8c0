"""Sampling through the whole engine: seeded determinism and the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import layout_models
from engine_helpers import assert_follows, make_engine, mode_layouts

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.sampling import target_probs

PROMPT = [5, 6, 7, 8]
# [8, x] occurred before for every even x: a row whose first token is even copies its second
# from the text (speculative/lookup.py), the others draft, so batches mix both
COPY_PROMPT = [t for x in range(0, 96, 2) for t in (8, x)] + PROMPT


@pytest.mark.parametrize("layout,mode", mode_layouts(["tiny", "production"]))
def test_same_seed_same_output(request, layout, mode):
    block = {"tiny": 4, "production": 16}[layout]
    models = layout_models(request, layout)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=20)
    a = generate(make_engine(models, mode, block=block), [PROMPT], p)[0].token_ids
    b = generate(make_engine(models, mode, block=block), [PROMPT], p)[0].token_ids
    assert a == b and len(a) == 20


def _exact_pair_distribution(hf, params: SamplingParams, vocab: int,
                             prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(x1, x2) under the target alone, [V, V]."""
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1], params)
        ctx = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = target_probs(hf(ctx).logits[:, -1], params)
    return p1.unsqueeze(1) * p2


@pytest.mark.parametrize("layout,block,engine_kw,prompt", [
    ("tiny", 3, {}, PROMPT), ("production", 16, {}, PROMPT),  # token trees, the default
    ("tiny", 3, {"tree_nodes": 0}, PROMPT),  # chains
    ("tiny", 3, {"draft_cutoff": 0.3}, PROMPT),  # blocks cut by the drafter's confidence
    ("tiny", 3, {}, COPY_PROMPT),  # copies from the text, alone and beside drafted rows
], ids=["tiny", "production", "tiny-chains", "tiny-cutoff", "tiny-copies"])
@pytest.mark.parametrize("mode", [Mode.ASYNC, Mode.SYNC])
def test_sampled_tokens_follow_the_target(request, layout, block, engine_kw, prompt, mode):
    """The first token comes from prefill and the second from speculative verification; their
    joint distribution must be the target's (chi-square over the likely pairs)."""
    models = layout_models(request, layout)
    hf = models[0]
    params = SamplingParams(temperature=2.5, top_k=6, max_new_tokens=2)
    exact = _exact_pair_distribution(hf, params, 96, prompt)
    n = 1200
    eng = make_engine(models, mode, block=block, batch=8, max_queue=n, **engine_kw)
    cycles = []
    eng.cycle_listeners.append(lambda rid, c: cycles.append(c))
    plist = [SamplingParams(temperature=2.5, top_k=6, max_new_tokens=2, seed=s) for s in range(n)]
    outs = generate(eng, [prompt] * n, plist)
    trees = [c.tree_nodes > 0 for c in cycles]
    if mode is Mode.SYNC:  # every cycle verifies trees, unless chains were asked for
        assert trees and all(trees) == (eng.proposals.tree_nodes > 0) and any(trees) == all(trees)
    if prompt is COPY_PROMPT and mode is Mode.SYNC:  # rows copied beside rows that drafted
        assert any(c.copied for c in cycles) and not all(c.copied for c in cycles)
    counts = torch.zeros(96, 96)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    assert_follows(counts, exact, n)  # nothing outside top-k is ever emitted


def test_exhaustive_pairs_helper_is_the_joint_distribution(tiny_models):
    """Its first-token marginal and one conditional equal the target's own next-token laws."""
    hf, params = tiny_models[0], SamplingParams(temperature=1.0)
    d = _exact_pair_distribution(hf, params, 96)  # [V, V]
    assert abs(float(d.sum()) - 1.0) < 1e-6
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1], params)
        x1 = int(p1.argmax())
        p2 = target_probs(hf(torch.tensor([PROMPT + [x1]])).logits[0, -1], params)
    torch.testing.assert_close(d.sum(1), p1, atol=1e-6, rtol=0)
    torch.testing.assert_close(d[x1] / d[x1].sum(), p2, atol=1e-5, rtol=0)


def _exact_sequence_distribution(hf, params: SamplingParams, length: int) -> dict:
    """{(x1..xL): probability} under the target alone, enumerating the top-k tree."""
    out, frontier = {}, [((), 1.0)]
    with torch.no_grad():
        for _ in range(length):
            nxt = []
            for prefix, prob in frontier:
                p = target_probs(hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1], params)
                for tok in torch.nonzero(p).flatten().tolist():
                    nxt.append((prefix + (tok,), prob * float(p[tok])))
            frontier = nxt
    for seq, prob in frontier:
        out[seq] = prob
    return out


# production at its smallest trained block: the oracle's cost grows with the pack size
@pytest.mark.parametrize("layout,block", [("tiny", 3), ("production", 4)])
def test_sampling_with_branch_hits_follows_the_target(request, layout, block):
    """Four sampled tokens through async cycles whose drafts often hit a pre-drafted branch
    (an oracle drafter): the joint distribution of the output must still be the target's."""
    models = layout_models(request, layout)
    from engine_helpers import OracleDrafter

    hf = models[0]
    n, length = 600, 4
    # A high temperature spreads the target's mass over its top-2 tree (the test has power);
    # a sharp oracle keeps drafts likely, so full acceptance and bonus branches happen.
    exact = _exact_sequence_distribution(hf, SamplingParams(temperature=8.0, top_k=2), length)
    assert max(exact.values()) < 0.5
    eng = make_engine(models, Mode.ASYNC, block=block, batch=8, max_queue=n)
    OracleDrafter(eng, hf, scale=10.0)
    plist = [SamplingParams(temperature=8.0, top_k=2, max_new_tokens=length, seed=s) for s in range(n)]
    outs = generate(eng, [PROMPT] * n, plist)
    counts: dict = {}
    hits = 0
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
        hits += o.stats.branch_hits
    assert set(counts) <= set(exact)  # nothing outside the target's top-k tree
    assert hits > 50  # the branch-hit path really carried tokens
    cells = sorted(exact, key=lambda k: -exact[k])
    big = [k for k in cells if exact[k] * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in cells if k not in big)]
    exp = [exact[k] * n for k in big] + [n * sum(exact[k] for k in cells if k not in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(big)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
