"""The full-depth drafter that shares SGLang's target (sglang_worker/pool_draft.py), without
sglang: SGLang's layer layout (fused qkv_proj and gate_up_proj) and a paged KV pool are stood in
by plain tensors. Its draft pass, reading the prefix from the pool through a scattered
req_to_token table, must give the drafts of the drafter's own definition (one pass over the
whole sequence, causal prefix, bidirectional masks), and it must hold no copy of a target
tensor. On CUDA too (gpu marker), at the shapes the tiny pair has."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import MASK_ID, D3DDrafter
from sglang_d3d.sglang_worker.contract import FakePool, sglang_like
from sglang_d3d.sglang_worker.counters import layer_copies
from sglang_d3d.sglang_worker.drafter_loading import build_shared_drafter
from sglang_d3d.sglang_worker.pool_draft import PoolDrafter, block_mask, own_bytes, rows_per_pass
from sglang_d3d.sglang_worker.shared_layers import fused_layers
from sglang_d3d.testing import tiny_hf_model


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def setup(request, tmp_path):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dev = torch.device(request.param)
    hf = tiny_hf_model("llama", seed=3, tied=False).to(dev)
    target = Decoder.from_hf(hf)
    own = D3DDrafter.init_from_target(target, None, block_size=4, rank=4, alpha=4.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in own.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(dev) * 0.05)
    own.save_pretrained(tmp_path / "drafter", dtype=torch.float32)
    sg = sglang_like(hf).to(dev)
    embed, head = sg.model.embed_tokens.weight, sg.lm_head.weight
    shared = build_shared_drafter(tmp_path / "drafter", hf.config, sg, dev, embed, head)
    return dev, hf, own, shared, sg


def reference_drafts(drafter: D3DDrafter, prompt: list[int], block: int, dev) -> list[int]:
    """The drafter's definition: one pass over [prompt[:-1] | anchor, masks], no cache."""
    prefix, anchor = prompt[:-1], prompt[-1]
    ids = torch.tensor([prefix + [anchor] + [MASK_ID] * (block - 1)], device=dev)
    p, t = len(prefix), ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    mask[p + 1 :, p:] = True  # masks see the anchor and each other
    pos = torch.arange(t, device=dev)[None]
    with torch.no_grad():
        h = drafter.hidden(ids, pos, mask[None])
        return drafter.logits(h[0, p : p + block - 1]).argmax(-1).tolist()


def pool_for(hf, prompts: list[list[int]], dev, total: int = 64):
    """Each prompt's committed prefix (all but its last token) in a pool at scattered slots,
    as the target computed it: (pool, req_to_token [N, 32], req_pool_indices, lens)."""
    cfg = hf.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    shape = (total, cfg.num_key_value_heads, hd)
    k = [torch.zeros(shape, device=dev) for _ in range(cfg.num_hidden_layers)]
    v = [torch.zeros(shape, device=dev) for _ in range(cfg.num_hidden_layers)]
    free = torch.randperm(total, generator=torch.Generator().manual_seed(1)).tolist()
    table = torch.zeros(len(prompts) + 1, 32, dtype=torch.int32, device=dev)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf(torch.tensor([prompt[:-1]], device=dev), use_cache=True)
        slots = [free.pop() for _ in prompt[:-1]]
        table[i + 1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        for layer in range(cfg.num_hidden_layers):
            kl, vl = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
            k[layer][slots] = kl[0].transpose(0, 1)
            v[layer][slots] = vl[0].transpose(0, 1)
    lens = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    return FakePool(k, v), table, torch.arange(1, len(prompts) + 1, device=dev), lens


@pytest.mark.parametrize("fused", [False, True], ids=["views", "fused"])
def test_drafts_from_the_pool_are_the_drafters_own(setup, fused):
    dev, hf, own, shared, sg = setup
    prompts = [[1, 5, 36, 77, 8, 12], [1, 9, 50, 11, 62, 13, 24, 30, 2], [1, 40, 41]]
    pool, table, rows, lens = pool_for(hf, prompts, dev)
    layers = fused_layers(shared, sg) if fused else None
    want = [reference_drafts(own, p, 4, dev) for p in prompts]
    for n in (1, 3):  # one row (its masks one run), and several
        last = torch.tensor([p[-1] for p in prompts[:n]], device=dev)
        drafter = PoolDrafter(shared, pool, table, block=4, fused=layers)
        drafts = drafter.draft(last, rows[:n], lens[:n], int(lens[:n].max()))
        assert drafts.tolist() == want[:n]


def test_row_groups_give_the_same_drafts(setup, monkeypatch):
    dev, hf, _, shared, _ = setup
    prompts = [[1, 5, 36, 77, 8, 12], [1, 9, 50, 11, 62, 13, 24], [1, 40, 41]]
    pool, table, rows, lens = pool_for(hf, prompts, dev)
    last = torch.tensor([p[-1] for p in prompts], device=dev)
    drafter = PoolDrafter(shared, pool, table, block=4)
    whole = drafter.draft(last, rows, lens, int(lens.max()))
    monkeypatch.setattr("sglang_d3d.sglang_worker.pool_draft.GATHER_BYTES", 1)
    import sglang_d3d.sglang_worker.pool_draft as pd

    monkeypatch.setattr(pd, "rows_per_pass", lambda *a, **k: 1)
    passes = drafter.passes
    assert drafter.draft(last, rows, lens, int(lens.max())).tolist() == whole.tolist()
    assert drafter.passes - passes == 3


def test_the_shared_drafter_holds_no_copy_of_the_target(setup):
    _, _, own, shared, sg = setup
    assert layer_copies(shared.layers, sg) == 0
    assert layer_copies(own.layers, sg) > 0  # a drafter built on its own target does
    assert own_bytes(shared) == own_bytes(own)  # deltas and mask embedding only


def test_block_mask_and_row_groups():
    m = block_mask(torch.tensor([2, 0]), 2, 3)  # [2, 3, 5]
    assert m[0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert m[1].int().tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert rows_per_pass(1000, 100, budget=250_000) == 2
    assert rows_per_pass(10**9, 100, budget=1) == 1
