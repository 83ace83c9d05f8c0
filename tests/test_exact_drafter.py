"""The drafter's passes on a 4-bit target's C++ layer loop (models/exact_drafter.py): clean rows
are the target's bitwise, mask rows carry the deltas, rows do not depend on each other, and the
results match the drafter's own modules."""

from __future__ import annotations

import pytest
import torch
from test_q4_target import tiny_llama_head_dim_64, write_q4_gguf

from sglang_d3d.models import cpu_kernels, int8_linear
from sglang_d3d.models.adapters import delta_modules
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.drafter import MASK_ID, D3DDrafter
from sglang_d3d.models.packing import branch_pack, extend_pack, layout
from sglang_d3d.models.q4_target import use_gguf_q4
from sglang_d3d.models.target import TargetRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels do not build here")

PROMPT = [(i * 7) % 90 + 3 for i in range(30)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(q4 Decoder on the C++ loop, full-depth drafter with random deltas, pruned drafter)."""
    hf = tiny_llama_head_dim_64()
    path = tmp_path_factory.mktemp("q4") / "tiny.Q4_1.gguf"
    write_q4_gguf(hf, path)
    q4 = Decoder.from_hf(hf)
    use_gguf_q4(q4, path, q8_head=True, kernels="cpp")
    drafter = D3DDrafter.init_from_target(q4, block_size=4).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in delta_modules(drafter.layers):
            m.delta_b.copy_(torch.randn(m.delta_b.shape, generator=gen) * 0.05)
        drafter.mask_embedding.add_(torch.randn(drafter.mask_embedding.shape, generator=gen) * 0.05)
    return q4, drafter, drafter.prune([0, 2, 3])


def _pass(drafter, runner_cache, packs, lens, fast=True):
    t = max(len(p.input_ids) for p in packs)
    ids, pos, write, mask = layout(packs, lens, t)
    with torch.inference_mode():
        return drafter.hidden(ids, pos, mask, runner_cache, list(range(len(packs))), write, fast=fast)


def test_the_drafter_runs_on_the_c_loop(models):
    _, drafter, pruned = models
    assert drafter.on_exact_loop() and pruned.on_exact_loop()


@pytest.mark.parametrize(("threads", "int8"), [(1, False), (2, False), (1, True)])
def test_clean_rows_are_the_targets_bitwise(models, threads, int8):
    """With the target's 14-bit rounding (coarse=False), a drafter pass's accepted tokens and
    anchor: the same hidden states' logits and the same keys and values as the target's own
    verify pass of those tokens (int8: a runner with int8 copies takes the 4-bit loop for a
    pass this small, DraftRunner._exact_loop)."""
    q4, drafter, _ = models
    if int8 and not int8_linear.available():
        pytest.skip("no int8 kernels in this torch")
    torch.set_num_threads(threads)
    try:
        target = TargetRunner(q4, 1, 128)
        target.prefill(0, PROMPT)
        new = [11, 12, 13]
        runner = DraftRunner(drafter, 1, 128, int8=int8, coarse=False)
        runner.cache.k.copy_(target.cache.k)  # the same prefix, as adopt copies it
        runner.cache.v.copy_(target.cache.v)
        runner.lengths[0] = len(PROMPT)
        logits = runner.run([(0, extend_pack(new, 4))])[0][0]  # [B, V]: the anchor's first
        verify = target.forward_block([0], torch.tensor([new]))[0]  # [3, V]
        assert torch.equal(logits[0], verify[-1])
        end = len(PROMPT) + len(new)
        assert torch.equal(runner.cache.k[:, 0, :end], target.cache.k[:, 0, :end])
        assert torch.equal(runner.cache.v[:, 0, :end], target.cache.v[:, 0, :end])
    finally:
        torch.set_num_threads(1)


def test_coarse_passes_round_inputs_to_8_bits_and_touch_only_the_drafters_cache(models):
    """The engine's default (coarse=True): clean rows come close to the target's but not to
    its bits, and they are written to the runner's own cache, never the target's."""
    q4, drafter, _ = models
    target = TargetRunner(q4, 1, 128)
    target.prefill(0, PROMPT)
    kept_k, new = target.cache.k.clone(), [11, 12, 13]
    runner = DraftRunner(drafter, 1, 128)
    assert runner.coarse
    runner.cache.k.copy_(target.cache.k)
    runner.cache.v.copy_(target.cache.v)
    runner.lengths[0] = len(PROMPT)
    logits = runner.run([(0, extend_pack(new, 4))])[0][0]  # [B, V]: the anchor's first
    verify = target.forward_block([0], torch.tensor([new]))[0]  # [3, V]
    assert not torch.equal(logits[0], verify[-1])
    assert (logits[0] - verify[-1]).abs().max() < 0.05 * verify[-1].abs().max()
    assert logits[0].argmax() == verify[-1].argmax()
    end = len(PROMPT)
    assert torch.equal(target.cache.k[:, 0, :end], kept_k[:, 0, :end])


def test_rows_do_not_depend_on_the_pass(models):
    """A block's outputs are the same bits alone or beside other branches and another slot."""
    q4, drafter, _ = models
    drafts = [21, 22, 23]
    wide = branch_pack(drafts, [(0, 7), (1, 8), (3, 9)], 4)
    alone = branch_pack(drafts, [(1, 8)], 4)
    runner = DraftRunner(drafter, 2, 160)
    for slot in (0, 1):
        runner.prefill(slot, PROMPT[: 20 + 5 * slot])
    lens = [runner.lengths[0], runner.lengths[1]]
    both = _pass(drafter, runner.cache, [wide, alone], lens)  # [2, t, H]
    one = _pass(drafter, runner.cache, [alone], [lens[0]])[0]
    n = len(alone.input_ids)
    assert torch.equal(both[0, : len(drafts)], one[: len(drafts)])  # the drafts
    assert torch.equal(both[0, 3 + 4 : 3 + 8], one[3:n])  # branch (1, 8): token + masks
    other = _pass(drafter, runner.cache, [alone], [lens[1]])  # slot 1 alone (its own cache)
    ids, pos, write, mask = layout([alone], [lens[1]], n)
    with torch.inference_mode():
        solo = drafter.hidden(ids, pos, mask, runner.cache, [1], write, fast=True)[0]
    assert torch.equal(both[1, :n], solo) and other.shape == solo.unsqueeze(0).shape


@pytest.mark.parametrize("which", ["full", "pruned"])
def test_mask_rows_carry_the_deltas_as_the_modules_do(models, which):
    """Against the drafter's own modules on the same (dequantised) weights: the C++ pass differs
    only by the 4-bit products' input rounding, far less than the deltas move a mask row."""
    _, full, pruned = models
    drafter = full if which == "full" else pruned
    pack = extend_pack([11, 12], 4)
    runner = DraftRunner(drafter, 1, 128)
    runner.prefill(0, PROMPT)
    lens = [runner.lengths[0]]
    ids, pos, write, mask = layout([pack], lens, len(pack.input_ids))
    ref_cache = drafter.make_cache(1, 128)
    ref_cache.k.copy_(runner.cache.k)
    ref_cache.v.copy_(runner.cache.v)
    with torch.inference_mode():
        got = drafter.hidden(ids, pos, mask, runner.cache, [0], write, fast=True)[0]
        ref = drafter.hidden(ids, pos, mask, ref_cache, [0], write, fast=False)[0]
        saved = [m.delta_b.clone() for _, m in delta_modules(drafter.layers)]
        for _, m in delta_modules(drafter.layers):
            m.delta_b.zero_()
        try:
            plain = drafter.hidden(ids, pos, mask, runner.cache, [0], write, fast=True)[0]
        finally:
            for (_, m), b in zip(delta_modules(drafter.layers), saved):
                m.delta_b.copy_(b)
    masks = (ids[0] == MASK_ID).nonzero().squeeze(1)
    moved = (got[masks] - plain[masks]).abs().max()
    assert moved > 0.05
    assert (got - ref).abs().max() < 0.1 * moved
    assert torch.equal(got[: len(pack.input_ids) - 3], plain[: len(pack.input_ids) - 3])  # clean rows


def test_a_delta_of_the_wrong_shape_is_refused(models):
    q4, drafter, _ = models
    from sglang_d3d.models.exact_drafter import delta_operands, exact_base

    exact, weights = exact_base(drafter)
    deltas = delta_operands(drafter.fused_layers(False))
    deltas[1] = deltas[1][:, :-1].contiguous()
    h = torch.zeros(1, 1, q4.arch.hidden_size)
    cos, sin = q4.rope_at(torch.tensor([[0]]), h)
    cache = drafter.make_cache(1, 8)
    from sglang_d3d.models.exact_pass import chain_plan

    with pytest.raises(RuntimeError, match="delta"):
        exact(h, cos, sin, cache, [0], torch.tensor([[0]]), chain_plan([0], 1), weights, deltas, [1])


def test_a_fused_pass_on_the_4bit_loop_verifies_as_the_target(models):
    """Verify and draft in one pass over the target's own cache (models/fused_runner.py): the
    verify block's logits are the target's own verify pass's, bitwise, beside the masks."""
    from sglang_d3d.models.fused_runner import FusedRunner
    from sglang_d3d.models.packing import fused_pack

    q4, drafter, _ = models
    target = TargetRunner(q4, 1, 160)
    target.prefill(0, PROMPT)
    verify = [11, 12, 13, 14]
    want = target.forward_block([0], torch.tensor([verify]))[0]  # [4, V]
    logits, branches = FusedRunner(drafter, target).run([(0, fused_pack(verify, [1, 3], 4))])[0]
    assert torch.equal(logits, want)
    assert branches.shape[:2] == (2, 3)
