"""The drafter's own KV cache: packed branch passes and commits must leave it exactly as a
fresh drafter that saw the accepted tokens one after another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.packing import branch_pack, extend_pack

BLOCK = 4


def fresh_block(drafter, context: list[int]) -> torch.Tensor:
    """[B, V] block logits of a drafter that sees `context` for the first time."""
    r = DraftRunner(drafter, 1, 256)
    return r.run([(0, extend_pack(context, BLOCK))])[0][0]


def test_batched_rows_with_different_lengths_match_single_rows(tiny_models):
    _, _, drafter = tiny_models
    r = DraftRunner(drafter, 3, 256)
    a, b = [5, 6, 7, 8, 9, 10, 11], [12, 13]
    out = r.run([(2, extend_pack(a, BLOCK)), (0, extend_pack(b, BLOCK))])
    assert torch.allclose(out[0][0], fresh_block(drafter, a))
    assert torch.allclose(out[1][0], fresh_block(drafter, b))
    assert r.lengths == [2, 0, 7]


def test_each_branch_equals_a_fresh_draft_of_its_hypothesis(tiny_models):
    _, _, drafter = tiny_models
    ctx, drafts = [5, 6, 7, 8, 9], [11, 12, 13]
    branches = [(0, 20), (2, 21), (3, 22)]
    r = DraftRunner(drafter, 2, 256)
    r.run([(1, extend_pack(ctx, BLOCK))])
    out = r.run([(1, branch_pack(drafts, branches, BLOCK))])[0]  # [3, B, V]
    for i, (n, c) in enumerate(branches):
        assert torch.allclose(out[i], fresh_block(drafter, ctx + drafts[:n] + [c]))
    assert r.lengths[1] == len(ctx)  # pre-drafting commits nothing


def test_hit_commit_leaves_cache_as_if_decoded_in_order(tiny_models):
    _, _, drafter = tiny_models
    ctx, drafts = [5, 6, 7, 8, 9], [11, 12, 13]
    r = DraftRunner(drafter, 1, 256)
    r.run([(0, extend_pack(ctx, BLOCK))])
    r.run([(0, branch_pack(drafts, [(0, 20), (2, 21)], BLOCK))])
    r.commit_branch(0, num_drafts=3, branch=1, accepted=2, block=BLOCK)
    assert r.lengths[0] == len(ctx) + 3
    nxt = r.run([(0, extend_pack([30], BLOCK))])[0][0]
    assert torch.allclose(nxt, fresh_block(drafter, ctx + [11, 12, 21, 30]))


def test_miss_keeps_accepted_drafts_and_extends(tiny_models):
    _, _, drafter = tiny_models
    ctx, drafts = [5, 6, 7, 8, 9], [11, 12, 13]
    r = DraftRunner(drafter, 1, 256)
    r.run([(0, extend_pack(ctx, BLOCK))])
    r.run([(0, branch_pack(drafts, [(0, 20)], BLOCK))])
    r.commit(0, 2)  # the target accepted d1, d2 and then said 40: no branch had that
    nxt = r.run([(0, extend_pack([40], BLOCK))])[0][0]
    assert torch.allclose(nxt, fresh_block(drafter, ctx + [11, 12, 40]))


def test_checkpoint_roundtrip(tiny_models, tmp_path):
    from sglang_d3d.models.drafter import D3DDrafter

    _, target, drafter = tiny_models
    drafter.save_pretrained(tmp_path / "d", dtype=torch.float64)
    again = D3DDrafter.from_pretrained(tmp_path / "d", target)
    assert torch.allclose(fresh_block(again, [5, 6, 7]), fresh_block(drafter, [5, 6, 7]))




def test_chunked_causal_prefill_equals_the_pack_path(tiny_models):
    """prefill() then a one-token pack gives the block the pack path gives for the whole
    context, across chunk boundaries."""
    _, _, drafter = tiny_models
    ctx = [(7 * i) % 90 + 3 for i in range(37)]
    want = fresh_block(drafter, ctx)
    r = DraftRunner(drafter, 2, 128)
    r.prefill(1, ctx[:-1], chunk=8)
    assert r.lengths[1] == 36
    got = r.run([(1, extend_pack(ctx[-1:], BLOCK))])[0][0]
    assert torch.allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("fp32", [False, True])
def test_fast_path_matches_the_plain_modules(tiny_models, tmp_path, fp32):
    """Fused target kernels + gated deltas give the plain drafter's block logits."""
    _, _, drafter = tiny_models
    if fp32:  # the packed kernels' own dtype
        from sglang_d3d.models.decoder import Decoder
        from sglang_d3d.models.drafter import D3DDrafter
        from sglang_d3d.models.loading import load_hf_model
        from sglang_d3d.testing import make_tiny_pair

        t_dir, d_dir = make_tiny_pair(tmp_path)
        drafter = D3DDrafter.from_pretrained(d_dir, Decoder.from_hf(load_hf_model(Path(t_dir))))
    ctx = [5, 9, 7, 3, 11, 40, 41]
    outs = []
    for fast in (False, True):
        r = DraftRunner(drafter, 1, 64, fast=fast)
        r.prefill(0, ctx[:4])
        drafts = [12, 13, 14]
        first = r.run([(0, extend_pack(ctx[4:], BLOCK))])[0]
        branch = r.run([(0, branch_pack(drafts, [(1, 20), (3, 21)], BLOCK))])[0]
        outs.append((first, branch))
    assert DraftRunner(drafter, 1, 8).fast
    for plain, fused in zip(*outs):
        assert torch.allclose(plain, fused, atol=1e-4 if fp32 else 1e-8)


def test_the_fast_path_is_built_before_the_first_pass(tiny_prod_models):
    """A runner stacks every delta group at construction, so the first draft does not pay for
    it (the adaptive controller would take that cost for the plan's)."""
    import copy

    drafter = copy.deepcopy(tiny_prod_models[2])
    drafter._fused = {}  # a fresh fast path, whatever earlier tests built on the shared one
    DraftRunner(drafter, 1, 32)
    groups = [p.deltas for layer in drafter.fused_layers()
              for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert groups and all(g.a is not None and g.b is not None for g in groups)
