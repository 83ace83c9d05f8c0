"""The compact delta stores: exact packing, bounded rounding, and a drafter that loads from them."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.cli import main
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.delta_store import (
    decode_state,
    dequantize,
    encode_state,
    group_size,
    pack_int4,
    quantize,
    unpack_int4,
)
from sglang_d3d.models.drafter import D3DDrafter, DrafterFormatError
from sglang_d3d.testing import tiny_hf_model
from sglang_d3d.training.compact import compact
from tests.drafter_helpers import IDS, noisy, run_block


@pytest.mark.parametrize("cols", [7, 8, 64, 128])
def test_int4_packing_round_trips(cols):
    q = torch.randint(-7, 8, (5, cols), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (cols + 1) // 2)
    assert torch.equal(unpack_int4(packed, cols), q)


def test_group_is_the_row_where_the_group_does_not_divide_it():
    assert group_size(576) == 64 and group_size(32) == 32 and group_size(40) == 40


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_error_is_at_most_half_a_step(bits):
    w = torch.randn(6, 128) * torch.logspace(-4, 0, 6).unsqueeze(1)  # rows of every scale
    q, scale = quantize(w, bits)
    assert q.abs().max() <= 2 ** (bits - 1) - 1
    step = scale.float().repeat_interleave(64, dim=1)  # [6, 128]
    # bf16 rounding of the scale may clip the largest number by under 1% of a step
    assert ((dequantize(q, scale) - w).abs() <= step * 0.51 + 1e-12).all()


def test_zero_rows_stay_zero():
    q, scale = quantize(torch.zeros(3, 64), 4)
    assert torch.equal(dequantize(q, scale), torch.zeros(3, 64))


def test_float_store_passes_through_and_unknown_store_is_refused():
    state = {"delta.0.q_proj.a": torch.randn(2, 4), "mask_embedding": torch.randn(4)}
    assert set(encode_state(state, "float")) == set(state)
    with pytest.raises(ValueError, match="unknown delta store"):
        encode_state(state, "int3")


def test_unknown_keys_reach_the_drafter_to_refuse(tmp_path):
    state = {"delta.0.q_proj.a": torch.randn(2, 64)}
    stored = encode_state(state, "int8")
    stored["stray"] = torch.zeros(1)
    got = decode_state(stored, "int8", {k: v.shape for k, v in state.items()})
    assert set(got) == {"delta.0.q_proj.a", "stray"}


@pytest.fixture()
def target():
    return Decoder.from_hf(tiny_hf_model())


@pytest.mark.parametrize("store", ["int8", "int4"])
def test_quantised_drafter_loads_its_quantised_deltas_exactly(target, tmp_path, store):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    d.save_pretrained(tmp_path, store=store)
    again = D3DDrafter.from_pretrained(tmp_path, target)
    assert again.cfg.delta_store == store
    shapes = {k: v.shape for k, v in d.own_state().items()}
    want = decode_state(encode_state(d.own_state(), store), store, shapes)
    got = again.own_state()
    for k, v in want.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k


def test_int8_drafts_closer_to_the_float_drafter_than_int4(target, tmp_path):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    with torch.no_grad():
        want = run_block(d, IDS)
        err = {}
        for store in ("int8", "int4"):
            d.save_pretrained(tmp_path / store, store=store)
            err[store] = (run_block(D3DDrafter.from_pretrained(tmp_path / store, target), IDS) - want)
    assert torch.equal(err["int8"][:, :4], torch.zeros_like(err["int8"][:, :4]))  # clean tokens
    assert 0 < err["int8"].abs().max() < 0.05 * want.abs().max() < err["int4"].abs().max()


def test_compact_writes_a_loadable_smaller_drafter(target, tmp_path):
    d = noisy(D3DDrafter.init_from_target(target, [0, 2, 3], 4, rank=4))
    d.save_pretrained(tmp_path / "float", dtype=torch.float32)
    (tmp_path / "ship").mkdir()
    (tmp_path / "ship" / "README").write_bytes(b"kept")
    out = compact(tmp_path / "float", tmp_path / "ship", "int4")
    assert out["bytes"] < (tmp_path / "float" / "model.safetensors").stat().st_size / 3  # tiny rows: a scale per 4
    assert (tmp_path / "ship" / "README").read_bytes() == b"kept"
    assert D3DDrafter.from_pretrained(tmp_path / "ship", target).cfg.delta_store == "int4"
    with pytest.raises(DrafterFormatError, match="stored as int4 already"):
        compact(tmp_path / "ship", tmp_path / "again", "int8")


def test_unknown_store_in_a_config_is_refused(target, tmp_path):
    D3DDrafter.init_from_target(target, [0, 3], 4, rank=4).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "delta_store": "int2"}))
    with pytest.raises(DrafterFormatError, match="unknown delta_store 'int2'"):
        D3DDrafter.from_pretrained(tmp_path, target)


def test_compact_without_a_drafter_says_so_and_writes_nothing(tmp_path, capsys):
    assert main(["compact", "--src", str(tmp_path / "none"), "--dst", str(tmp_path / "out")]) == 2
    assert "holds no drafter" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_short_rows_are_stored_transposed_and_read_back():
    b = torch.randn(128, 4)  # B at rank 4: [out, r]
    stored = encode_state({"delta.0.q_proj.b": b}, "int4")
    assert set(stored) == {"delta.0.q_proj.b.qt", "delta.0.q_proj.b.scale_t"}
    assert stored["delta.0.q_proj.b.scale_t"].shape == (4, 2)  # a scale per 64 outputs
    got = decode_state(stored, "int4", {"delta.0.q_proj.b": b.shape})["delta.0.q_proj.b"]
    q, scale = quantize(b.T.contiguous(), 4)
    assert torch.equal(got, dequantize(q, scale).T)


@pytest.mark.parametrize("bits", [8, 4])
def test_files_that_stored_every_matrix_by_rows_still_load(bits):
    b = torch.randn(128, 4)
    q, scale = quantize(b, bits)  # how earlier files wrote B: by rows
    old = {"delta.0.q_proj.b.q": pack_int4(q) if bits == 4 else q, "delta.0.q_proj.b.scale": scale}
    store = {8: "int8", 4: "int4"}[bits]
    got = decode_state(old, store, {"delta.0.q_proj.b": b.shape})
    assert set(got) == {"delta.0.q_proj.b"} and torch.equal(got["delta.0.q_proj.b"], dequantize(q, scale))
