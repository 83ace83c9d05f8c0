"""Cutting the deltas' rank: the best lower-rank product, the scale folded in, and a drafter
that `d3d compact --rank` writes and loads."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.cli import main
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.delta_rank import singular_values, truncate, truncate_state
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.testing import tiny_hf_model
from sglang_d3d.training.compact import compact
from tests.drafter_helpers import IDS, noisy, run_block


def _pair(r=6, out=20, inp=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(r, inp, generator=gen, dtype=torch.float64), torch.randn(
        out, r, generator=gen, dtype=torch.float64)


def test_the_cut_is_the_best_rank_k_approximation():
    a, b = _pair()
    u, s, vh = torch.linalg.svd(b @ a)
    for k in (1, 3, 5):
        a2, b2 = truncate(a, b, k)
        assert a2.shape == (k, 12) and b2.shape == (20, k)
        best = (u[:, :k] * s[:k]) @ vh[:k]  # Eckart-Young
        assert torch.allclose(b2 @ a2, best, atol=1e-10)


def test_the_full_rank_keeps_the_product_and_the_scale_is_folded_in():
    a, b = _pair()
    a2, b2 = truncate(a, b, 6, scale=2.0, new_scale=0.5)
    assert torch.allclose(0.5 * b2 @ a2, 2.0 * b @ a, atol=1e-10)


def test_singular_values_are_the_products():
    a, b = _pair()
    assert torch.allclose(singular_values(a, b), torch.linalg.svdvals(b @ a)[:6], atol=1e-10)


@pytest.mark.parametrize("k", [0, 7])
def test_a_rank_outside_one_to_r_is_refused(k):
    a, b = _pair()
    with pytest.raises(ValueError, match="must be 1 to the deltas' rank 6"):
        truncate(a, b, k)


def test_truncate_state_cuts_every_delta_and_says_what_it_kept():
    a, b = _pair(r=4)
    state = {"delta.0.q_proj.a": a, "delta.0.q_proj.b": b, "mask_embedding": torch.ones(3)}
    out, kept = truncate_state(state, rank=4, alpha=8.0, k=2)
    assert out["delta.0.q_proj.a"].shape == (2, 12) and out["delta.0.q_proj.b"].shape == (20, 2)
    assert torch.equal(out["mask_embedding"], state["mask_embedding"])
    s2 = torch.linalg.svdvals(b @ a)[:4].square()
    assert kept == pytest.approx(float(s2[:2].sum() / s2.sum()))
    # alpha / rank scales the delta: 8/2 after the cut against 8/4 before
    want = truncate(a, b, 2)
    assert torch.allclose(4.0 * out["delta.0.q_proj.b"] @ out["delta.0.q_proj.a"],
                          2.0 * want[1] @ want[0], atol=1e-10)


@pytest.fixture()
def target():
    return Decoder.from_hf(tiny_hf_model())


def test_compact_at_the_trained_rank_drafts_as_before(target, tmp_path):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    d.save_pretrained(tmp_path / "float", dtype=torch.float32)
    out = compact(tmp_path / "float", tmp_path / "same", "float", rank=4)
    assert out["rank"] == 4 and out["energy_kept"] == pytest.approx(1.0)
    compact(tmp_path / "float", tmp_path / "plain", "float")  # the float store rounds to bf16
    with torch.no_grad():
        want = run_block(d, IDS)
        err = {name: (run_block(D3DDrafter.from_pretrained(tmp_path / name, target), IDS) - want)
               .abs().max() for name in ("same", "plain")}
    assert 0 < err["same"] < 2 * err["plain"]  # the rotation only moves bf16's rounding


def test_compact_rank_writes_a_smaller_drafter_that_loads(target, tmp_path):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    d.save_pretrained(tmp_path / "float", dtype=torch.float32)
    out = compact(tmp_path / "float", tmp_path / "cut", "float", rank=2)
    assert out["rank"] == 2 and 0 < out["energy_kept"] < 1
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["adapter_rank"] == 2
    assert out["bytes"] < (tmp_path / "float" / "model.safetensors").stat().st_size
    cut = D3DDrafter.from_pretrained(tmp_path / "cut", target)
    with torch.no_grad():
        got, want = run_block(cut, IDS), run_block(d, IDS)
    assert torch.equal(got[:, :4], want[:, :4])  # clean tokens never see the deltas
    assert not torch.allclose(got[:, 4:], want[:, 4:])


def test_compact_refuses_a_rank_above_the_trained_one_and_writes_nothing(target, tmp_path, capsys):
    D3DDrafter.init_from_target(target, [0, 3], 4, rank=4).save_pretrained(tmp_path / "float")
    args = ["compact", "--src", str(tmp_path / "float"), "--dst", str(tmp_path / "out"), "--rank", "8"]
    assert main(args) == 2
    assert "--rank 8: must be 1 to the deltas' rank 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
