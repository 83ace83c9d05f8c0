"""Fused mode: the verify pass also drafts the next block (speculative/fused.py). Its outputs are
the target's, token for token under greedy and in distribution under sampling; its branches
sit where the next block's drafts belong; and it refuses drafters it cannot fuse with."""

from __future__ import annotations

import pytest
import torch
from conftest import _load, reference_greedy
from engine_helpers import assert_follows, make_engine

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.adaptive import Plan
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.drafter import MASK_ID
from sglang_d3d.models.fused_runner import FusedRunner
from sglang_d3d.models.packing import fused_pack
from sglang_d3d.models.target import TargetRunner
from sglang_d3d.speculative.fused import choose_anchors, outcome_probs
from sglang_d3d.speculative.sampling import target_probs

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15]]


# ---- the maths ----------------------------------------------------------------------------------
def test_outcome_probs():
    assert outcome_probs([]) == [1.0]
    p = outcome_probs([0.5, 0.8])
    assert p == pytest.approx([0.5, 0.5 * 0.2, 0.5 * 0.8])
    assert sum(p) == pytest.approx(1.0)


def test_choose_anchors_takes_the_likeliest_outcomes_in_order():
    assert choose_anchors([], 3) == [0]  # nothing to verify: the token alone
    assert choose_anchors([0.9, 0.9, 0.9], 1) == [3]  # all accepted is likeliest
    assert choose_anchors([0.1, 0.9], 2) == [0, 2]  # P = .9, .01, .09
    assert choose_anchors([0.6, 0.5, 0.1], 2) == [0, 1]  # P = .4, .3, .27, .03
    assert choose_anchors([0.95, 0.95, 0.1], 2) == [2, 3]  # P = .05, .05, .81, .09


# ---- the pack and the pass ----------------------------------------------------------------------
def test_fused_pack_anchors_masks_at_verify_tokens():
    p = fused_pack([30, 31, 32], anchors=[0, 2], block=3)
    assert p.input_ids == [30, 31, 32, MASK_ID, MASK_ID, MASK_ID, MASK_ID]
    assert p.blocks == [[0, 1, 2], [0, 3, 4], [2, 5, 6]]
    assert p.rel_pos == [0, 1, 2, 1, 2, 3, 4]  # a branch continues right after its anchor
    assert [sorted(s) for s in p.sees[:3]] == [[0], [0, 1], [0, 1, 2]]  # causal verify
    assert sorted(p.sees[3]) == [0, 3, 4]  # anchored at 0: sees it and its own masks
    assert sorted(p.sees[6]) == [0, 1, 2, 5, 6]


@pytest.mark.parametrize("fast", [True, False])  # False: the HF modules, as on a GPU
def test_fused_pass_verifies_exactly_as_the_target(tiny_prod_models, fast):
    """The verify rows of a fused pass give the target's logits and cache entries; the masks
    change neither, and nothing is committed."""
    _, target, drafter = tiny_prod_models
    runner = TargetRunner(target, 2, 80, fast=fast)
    runner.prefill(0, [5, 6, 7, 8, 9])
    runner.prefill(1, [10, 11])
    fused = FusedRunner(drafter, runner)
    blocks = [[9, 20, 21, 22], [11, 30]]
    out = fused.run([(0, fused_pack(blocks[0], [0, 3], 4)), (1, fused_pack(blocks[1], [1], 4))])
    assert runner.lengths[:2] == [5, 2]
    keys = runner.cache.k[:, :2, :9].clone()
    for slot, (verify, branches), toks in zip((0, 1), out, blocks):
        want = runner.forward_block([slot], torch.tensor([toks]))[0]
        assert verify.dtype == want.dtype and torch.allclose(verify, want, atol=1e-12)
        assert branches.shape[1] == 3 and torch.isfinite(branches).all()
    assert out[0][1].shape[0] == 2 and out[1][1].shape[0] == 1
    assert torch.allclose(runner.cache.k[:, 0, 5:9], keys[:, 0, 5:9])  # verify entries: the target's
    assert torch.allclose(runner.cache.k[:, 1, 2:4], keys[:, 1, 2:4])


def test_fused_mode_refuses_a_pruned_drafter(tiny_models):
    with pytest.raises(ValueError, match="full-depth drafter"):
        make_engine(tiny_models, Mode.FUSED)


def test_fused_mode_refuses_another_dtype(tiny_prod_models):
    hf, target, drafter = tiny_prod_models
    import copy

    other = copy.deepcopy(drafter).float()
    with pytest.raises(ValueError, match="as one model"):
        make_engine((hf, target, other), Mode.FUSED)


def test_sglang_plugin_takes_fused_mode_every_cycle():
    from sglang_d3d.sglang_worker.options import PluginOptions

    opts = PluginOptions.from_env({"SGLANG_D3D_MODE": "fused"})
    assert opts.mode is Mode.FUSED and not opts.plan_per_load  # sglang_worker/fused_cycle.py


# ---- the engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block,budget", [(4, 1), (4, 4), (8, 2), (16, 1)])
def test_fused_equals_target_greedy(tiny_prod_models, block, budget):
    hf = tiny_prod_models[0]
    eng = make_engine(tiny_prod_models, Mode.FUSED, block, budget=budget, batch=2)  # one joins late
    outs = generate(eng, PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.error is None
        assert out.token_ids == reference_greedy(hf, prompt, 24)
        assert out.stats.branch_hits + out.stats.branch_misses > 0


def test_fused_qwen3(tmp_path):
    from sglang_d3d.testing import make_tiny_pair

    models = _load(*make_tiny_pair(tmp_path, arch="qwen3", seed=1, layer_ids=(0, 1, 2, 3)))
    outs = generate(make_engine(models, Mode.FUSED, 4), PROMPTS, SamplingParams(max_new_tokens=16))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(models[0], prompt, 16)


def test_fused_adaptive_equals_target_greedy(tiny_prod_models):
    hf = tiny_prod_models[0]
    eng = make_engine(tiny_prod_models, Mode.FUSED, 8, budget=2, adaptive=True)
    assert set(eng.controller.candidates) == {Plan(1), Plan(4), Plan(8)}
    outs = generate(eng, PROMPTS, SamplingParams(max_new_tokens=40))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(hf, prompt, 40)


class OracleBranches:
    """Replaces each branch's mask logits by the target's true continuation after the
    anchor's own next token: if branches sit where the next block belongs, every draft after
    the first cycle is accepted."""

    def __init__(self, engine, hf) -> None:
        self.engine, self.hf = engine, hf
        self.real = engine.drafting.runner.run
        engine.drafting.runner.run = self.run

    def run(self, rows):
        out = self.real(rows)
        return [(v, self._truth(slot, pack, v, b)) for (slot, pack), (v, b) in zip(rows, out)]

    def _truth(self, slot, pack, verify, branches):
        seq = next(s for s in self.engine.scheduler.running if s.slot == slot)
        fake = torch.full_like(branches, -20.0)
        for k, block in enumerate(pack.blocks[1:]):
            j = block[0]
            ctx = seq.tokens + pack.input_ids[1 : j + 1] + [int(verify[j].argmax())]
            for m, tok in enumerate(reference_greedy(self.hf, ctx, branches.shape[1])):
                fake[k, m, tok] = 20.0
        return fake


@pytest.mark.parametrize("block", [4, 6])
def test_branches_predict_the_next_block(tiny_prod_models, block):
    hf = tiny_prod_models[0]
    eng = make_engine(tiny_prod_models, Mode.FUSED, block, budget=1)
    OracleBranches(eng, hf)
    out = generate(eng, [PROMPTS[0]], SamplingParams(max_new_tokens=31))[0]
    assert out.token_ids == reference_greedy(hf, PROMPTS[0], 31)
    lengths = out.stats.accepted_lengths
    assert lengths[0] == 1  # the first cycle has nothing to verify yet
    assert all(n == block for n in lengths[1:-1])  # then every block is right in full
    assert out.stats.branch_misses == 0


def test_unusable_branch_output_costs_no_tokens(tiny_prod_models):
    hf = tiny_prod_models[0]
    eng = make_engine(tiny_prod_models, Mode.FUSED, 4, budget=4)
    real, calls = eng.drafting.runner.run, {"n": 0}

    def broken(rows):
        calls["n"] += 1
        out = real(rows)
        return [(v, torch.full_like(b, float("nan"))) if calls["n"] % 3 == 0 else (v, b)
                for v, b in out]

    eng.drafting.runner.run = broken
    out = generate(eng, [PROMPTS[1]], SamplingParams(max_new_tokens=30))[0]
    assert out.token_ids == reference_greedy(hf, PROMPTS[1], 30)
    assert out.stats.fallbacks >= 1


def _exact_triples(hf, prompt, params, vocab) -> torch.Tensor:
    """P(x1, x2, x3) under the target alone, [V, V, V] (zero outside each step's top-k)."""
    out = torch.zeros(vocab, vocab, vocab)
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1], params)
        for a in p1.nonzero().flatten().tolist():
            p2 = target_probs(hf(torch.tensor([prompt + [a]])).logits[0, -1], params)
            for b in p2.nonzero().flatten().tolist():
                p3 = target_probs(hf(torch.tensor([prompt + [a, b]])).logits[0, -1], params)
                out[a, b] = p1[a] * p2[b] * p3
    return out


def test_fused_sampling_follows_the_target(tiny_prod_models):
    """x1 comes from prefill, x2 from a fused pass with nothing to verify, x3 from rejection
    sampling against the drafts that pass made: their joint law must be the target's."""
    hf = tiny_prod_models[0]
    prompt = [5, 6, 7, 8]
    base = SamplingParams(temperature=1.5, top_k=3, max_new_tokens=3)
    exact = _exact_triples(hf, prompt, base, 96)
    n = 1500
    eng = make_engine(tiny_prod_models, Mode.FUSED, 4, budget=4, batch=8, max_queue=n)
    plist = [SamplingParams(temperature=1.5, top_k=3, max_new_tokens=3, seed=s) for s in range(n)]
    outs = generate(eng, [prompt] * n, plist)
    counts = torch.zeros(96, 96, 96)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    assert sum(o.stats.accepted_lengths[1] > 1 for o in outs) > 0  # drafts were accepted
    assert_follows(counts, exact, n)
