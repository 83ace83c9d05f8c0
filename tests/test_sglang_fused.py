"""A fused forward's rows (sglang_worker/fused_layout.py) and their attention on torch_native
(torch_native_verify.py): the verify rows attend exactly as a plain verify's (bit for bit: the
target's verify is unchanged by the mask rows beside it), and each mask row attends its prefix,
the verify tokens up to its anchor and its own branch, never another branch. SGLang's backend
and pool are stood in by plain objects; sglang is needed for its KV write location."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from sglang_d3d.sglang_worker import torch_native_verify
from sglang_d3d.sglang_worker.contract import FakePool
from sglang_d3d.sglang_worker.fused_layout import anchors_for, batch_layout, row_shape


def test_row_shape_places_branches_after_their_anchors():
    s = row_shape(4, (0, 2), 3)
    assert s.rel_pos == (0, 1, 2, 3, 1, 2, 3, 3, 4, 5)
    assert s.sees_verify[:3] == ((True, False, False, False),) * 3
    assert s.sees_verify[3:] == ((True, True, True, False),) * 3
    own = [[i // 3 == j // 3 for j in range(6)] for i in range(6)]  # a branch sees itself only
    assert [list(r) for r in s.sees_masks] == own


def test_anchors_cover_every_outcome_or_the_likeliest():
    assert anchors_for([0.9, 0.1, 0.5], 4, 4) == (0, 1, 2, 3)
    assert anchors_for(None, 4, 6) == (0, 1, 2, 3, 3, 3)
    assert anchors_for(None, 4, 2) == (0, 1)  # placeholders: outcome 0 is certain
    # keep 0.9, 0.1: P(0) = 0.1, P(1) = 0.81, P(2) = 0.081, P(3) = 0.009
    assert anchors_for([0.9, 0.1, 0.5], 4, 2) == (0, 1)
    # keep 0.95 each: P(3) = 0.857, then P(0) = 0.05 > P(1) = 0.0475
    assert anchors_for([0.95, 0.95, 0.95], 4, 2) == (0, 3)


class FakeKV(FakePool):
    def set_kv_buffer(self, layer, loc, k, v) -> None:
        self.k[layer.layer_id][loc.loc] = k.view(-1, *self.k[0].shape[1:])
        self.v[layer.layer_id][loc.loc] = v.view(-1, *self.v[0].shape[1:])


def _backend(pool, req_to_token):
    b = SimpleNamespace(token_to_kv_pool=pool, swa_out_cache_loc=None,
                        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                        init_forward_metadata=lambda fb: None,
                        forward_extend=lambda *a, **k: pytest.fail("SGLang's own kernel ran"))
    torch_native_verify.install(b)
    return b


def _forward(backend, q, k, v, layer, lens, rpi, loc, t, layout=None):
    mode = SimpleNamespace(is_target_verify=lambda: True)
    fb = SimpleNamespace(forward_mode=mode, extend_prefix_lens_cpu=lens.tolist(),
                         extend_seq_lens_cpu=[t] * len(lens), req_pool_indices=rpi,
                         extend_prefix_lens=lens, out_cache_loc=loc)
    fb.spec_info = SimpleNamespace()
    if layout is not None:
        setattr(fb.spec_info, torch_native_verify.FUSED, layout)
    backend.init_forward_metadata(fb)
    return backend.forward_extend(q, k, v, layer, fb)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_fused_attention_keeps_verify_rows_and_sees_only_its_branch():
    from sglang_d3d.sglang_worker.cpu_harness import install

    install()  # sglang importable on CPU (its KV write location)
    torch.manual_seed(0)
    hq, hkv, d, slots, w, m = 4, 2, 8, 128, 4, 3
    anchors = [(0, 1, 2, 3), (1, 3, 3, 3)]
    lens = torch.tensor([5, 9])
    rpi = torch.tensor([1, 0])
    req_to_token = torch.randperm(slots - 1)[: 2 * 32].view(2, 32) + 1  # scattered, never 0
    pool = FakeKV([torch.randn(slots, hkv, d)], [torch.randn(slots, hkv, d)])
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=hq, tp_k_head_num=hkv, qk_head_dim=d,
                            v_head_dim=d, scaling=d**-0.5, is_cross_attention=False,
                            sliding_window_size=None)
    layout = batch_layout(anchors, w, m, torch.device("cpu"))
    n, t = 2, layout.tokens
    q, k, v = torch.randn(n * t, hq * d), torch.randn(n * t, hkv, d), torch.randn(n * t, hkv, d)
    verify_loc = torch.stack([req_to_token[r, int(s) : int(s) + w] for r, s in zip(rpi, lens)])
    loc = torch.zeros(n, t, dtype=torch.int64)
    loc[:, :w] = verify_loc
    rows = torch.arange(n * t).view(n, t)
    before = pool.k[0].clone()
    fused = _forward(_backend(pool, req_to_token), q, k, v, layer, lens, rpi, loc.view(-1), t,
                     layout).view(n, t, hq * d)
    vr = rows[:, :w].reshape(-1)
    plain = _forward(_backend(pool, req_to_token), q[vr], k[vr], v[vr], layer, lens, rpi,
                     verify_loc.reshape(-1), w).view(n, w, hq * d)
    assert torch.equal(fused[:, :w], plain)  # bit for bit

    for i in range(n):  # each mask row against a dense reference over the keys it may see
        shape = row_shape(w, anchors[i], m)
        for r in range(len(shape.sees_verify)):
            keys = list(req_to_token[rpi[i], : int(lens[i])])
            keys += [verify_loc[i, j] for j in range(w) if shape.sees_verify[r][j]]
            own = [w + j for j in range(len(shape.sees_masks)) if shape.sees_masks[r][j]]
            kk = torch.cat([pool.k[0][torch.tensor(keys)], k[rows[i, own]]])  # [S, Hkv, D]
            vv = torch.cat([pool.v[0][torch.tensor(keys)], v[rows[i, own]]])
            qq = q[rows[i, w + r]].view(hq, 1, d)
            ref = torch.nn.functional.scaled_dot_product_attention(
                qq, kk.transpose(0, 1).repeat_interleave(hq // hkv, 0),
                vv.transpose(0, 1).repeat_interleave(hq // hkv, 0), scale=d**-0.5)
            torch.testing.assert_close(fused[i, w + r], ref.reshape(-1), rtol=1e-5, atol=1e-5)

    # Writes: the verify rows at their reserved slots, the mask rows at the padding slot only.
    changed = (pool.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(verify_loc.flatten().tolist()) | {0}
