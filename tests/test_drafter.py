"""The drafter's delta format: what it shares, what it stores, what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.models.decoder import Batch, Decoder
from sglang_d3d.models.drafter import D3DDrafter, DrafterFormatError, target_fingerprint
from sglang_d3d.testing import tiny_hf_model
from tests.drafter_helpers import IDS, noisy, run_block


@pytest.fixture()
def target():
    return Decoder.from_hf(tiny_hf_model())




def test_fresh_full_depth_drafter_is_the_target_on_clean_tokens(target):
    d = noisy(D3DDrafter.init_from_target(target, None, 4, rank=4))
    t = 4
    b = Batch(torch.arange(t).unsqueeze(0), torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0))
    with torch.no_grad():
        want = target(IDS[:, :t], b)
        got = d.logits(d.hidden(IDS[:, :t], b.positions, b.mask))
    assert torch.allclose(got, want, atol=1e-5)  # deltas never touch clean tokens


def test_deltas_change_only_mask_slots(target):
    zero = D3DDrafter.init_from_target(target, None, 4, rank=4)
    trained = noisy(D3DDrafter.init_from_target(target, None, 4, rank=4))
    with torch.no_grad():
        a, b = run_block(zero, IDS), run_block(trained, IDS)
    assert torch.allclose(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_drafter_shares_and_never_changes_the_target_weights(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    d = noisy(D3DDrafter.init_from_target(target, [0, 3], 4, rank=4))
    assert d.layers[1].self_attn.q_proj.base.weight is target.layers[3].self_attn.q_proj.weight
    assert not hasattr(target.layers[3].self_attn.q_proj, "delta_a")
    with torch.no_grad():
        run_block(d, IDS)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_format_rebuilds_the_drafter_exactly(target, tmp_path, dtype):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    d.save_pretrained(tmp_path, dtype=dtype)
    with torch.no_grad():  # what the stored precision keeps
        for p in d.trainable_parameters():
            p.copy_(p.to(dtype).float())
    again = D3DDrafter.from_pretrained(tmp_path, target)
    assert again.cfg == d.cfg
    with torch.no_grad():
        assert torch.equal(run_block(again, IDS), run_block(d, IDS))
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["block_layout"] == "anchor" and stored["source_layers"] == [0, 2, 3]


def test_checkpoint_holds_only_deltas_and_mask_embedding(target, tmp_path):
    from safetensors.torch import load_file

    D3DDrafter.init_from_target(target, [0, 3], 4, rank=4).save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "mask_embedding" in keys
    assert keys - {"mask_embedding"} == {f"delta.{i}.{p}.{ab}" for i in (0, 1) for ab in "ab"
                                         for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj")}


def test_checkpoint_in_the_old_masks_layout_is_refused(target, tmp_path):
    D3DDrafter.init_from_target(target, [0, 3], 4, rank=4).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    old = {k: v for k, v in cfg.items() if k not in ("block_layout", "version",
                                                        "target_fingerprint")}
    (tmp_path / "config.json").write_text(json.dumps({**old, "version": 1}))
    with pytest.raises(DrafterFormatError, match="block layout 'masks'.*Retrain"):
        D3DDrafter.from_pretrained(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "block_layout": "masks"}))
    with pytest.raises(DrafterFormatError, match="masks"):
        D3DDrafter.from_pretrained(tmp_path, target)


def test_drafter_for_another_target_is_refused(target, tmp_path):
    D3DDrafter.init_from_target(target, [0, 3], 4, rank=4).save_pretrained(tmp_path)
    other = Decoder.from_hf(tiny_hf_model(seed=5))
    assert target_fingerprint(other) != target_fingerprint(target)
    with pytest.raises(DrafterFormatError, match="another target"):
        D3DDrafter.from_pretrained(tmp_path, other)


def test_fingerprint_ignores_the_target_dtype(target):
    fp = target_fingerprint(target)
    assert target_fingerprint(Decoder.from_hf(tiny_hf_model().to(torch.bfloat16))) == fp


def test_prune_keeps_the_deltas_of_kept_layers(target):
    d = noisy(D3DDrafter.init_from_target(target, [0, 1, 2, 3], 4, rank=4))
    p = d.prune([1, 3])
    assert p.cfg.source_layers == (1, 3) and not p.is_full_depth and d.is_full_depth
    assert torch.equal(p.layers[0].mlp.up_proj.delta_b, d.layers[1].mlp.up_proj.delta_b)
    assert p.layers[0].mlp.up_proj.delta_b is not d.layers[1].mlp.up_proj.delta_b
    with torch.no_grad():
        p.layers[0].mlp.up_proj.delta_b.add_(1.0)
    assert not torch.equal(p.layers[0].mlp.up_proj.delta_b, d.layers[1].mlp.up_proj.delta_b)


def test_dtype_auto_follows_the_hardware(monkeypatch):
    from sglang_d3d.models import loading

    monkeypatch.setattr(loading, "has_bf16_matrix_units", lambda: False)
    assert loading.resolve_dtype("auto", "cpu") == torch.float32
    assert loading.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert loading.resolve_dtype("float16", "cpu") == torch.float16
    monkeypatch.setattr(loading, "has_bf16_matrix_units", lambda: True)
    assert loading.resolve_dtype("auto", "cpu") == torch.bfloat16


def test_the_engine_serves_in_fp32_on_any_cpu(monkeypatch):
    """Training may take bf16 on AMX; the engine's CPU passes are exact in fp32 only."""
    from sglang_d3d.engine.factory import engine_dtype
    from sglang_d3d.models import loading

    monkeypatch.setattr(loading, "has_bf16_matrix_units", lambda: True)
    assert engine_dtype("auto", "cpu") == "float32"
    assert engine_dtype("auto", "cuda") == "bfloat16"
    assert engine_dtype("bfloat16", "cpu") == "bfloat16"
