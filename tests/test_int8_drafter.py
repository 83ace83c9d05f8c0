"""The drafter's int8 weights (models/int8_linear.py): the maths alone, the drafts close to the
full-precision ones, the target's output unchanged, and a clear refusal where int8 cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.offline import generate
from sglang_d3d.models import int8_linear
from sglang_d3d.models.adapters import Gate, LowRankDelta
from sglang_d3d.models.cpu_linear import PackedLinear
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.int8_deltas import Int8Gated
from sglang_d3d.models.int8_linear import (
    AVX2_LEVELS,
    FULL_LEVELS,
    Int8Linear,
    Int8Setting,
    quantize_rows,
    sums_in_int32,
    use_int8,
    weight_levels,
)
from sglang_d3d.models.packing import extend_pack

pytestmark = pytest.mark.skipif(not int8_linear.available(), reason="no fbgemm in this torch")

PROMPTS = [[5, 9, 7, 3, 11, 40, 41], [12, 13, 3], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def fp32_models(tiny_pair_dir):
    """The tiny llama pair in float32, where int8 applies (the shared fixtures are float64)."""
    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model

    target = Decoder.from_hf(load_hf_model(Path(tiny_pair_dir[0])).float())
    return target, D3DDrafter.from_pretrained(tiny_pair_dir[1], target)


def test_quantize_rows_is_symmetric_per_row_within_half_a_step():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.0, -2.0]])
    q, scale = quantize_rows(w, levels=127)
    assert q.dtype == torch.int8 and scale.shape == (3,)
    assert q[0].tolist() == [64, -127, 32] and q[2, 0] == 127  # each row's largest -> +-levels
    assert scale[1] == 1.0 and q[1].abs().sum() == 0  # a zero row stays zero
    err = (q.double() * scale[:, None] - w.double()).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-12).all())


def test_weight_levels_drop_to_7_bits_where_int16_pair_sums_would_saturate():
    """AVX2's int8 product adds two u8 x s8 products in int16; 255 * 127 * 2 saturates there,
    and then the weights get +-63 levels (255 * 63 * 2 fits)."""

    def saturating(x, w):  # int16 pair sums: what AVX2's vpmaddubsw does to the worst case
        return (x @ w.T).clamp(max=32767 * 5.0 / 255 * 32 / 127)

    assert not sums_in_int32(saturating)
    assert sums_in_int32(lambda x, w: x @ w.T)
    assert AVX2_LEVELS * 255 * 2 <= 32767 < FULL_LEVELS * 255 * 2
    assert weight_levels() == (FULL_LEVELS if sums_in_int32(
        lambda x, w: Int8Linear(w, None, Int8Setting(FULL_LEVELS))(x)) else AVX2_LEVELS)
    q, _ = quantize_rows(torch.randn(64, 32), AVX2_LEVELS)
    assert int(q.abs().max()) == 63


def test_int8_linear_does_not_saturate_on_large_same_sign_inputs():
    """The worst case for AVX2's pair sums: every activation at the top of its range and
    every weight at its largest level, same sign."""
    w, x = torch.ones(8, 64), torch.full((3, 64), 5.0)
    y = Int8Linear(w, None)(x)
    assert torch.allclose(y, x @ w.T, rtol=0.02)


def test_int8_linear_keeps_shape_and_bias_and_is_close():
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 32), torch.randn(40), torch.randn(2, 5, 32)
    y = Int8Linear(w, b)(x)
    ref = x @ w.T + b
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    assert (y - ref).norm() / ref.norm() < 0.05  # 7-bit activations, 8-bit weights


def test_use_int8_follows_the_setting_and_refuses_where_it_cannot_run():
    cpu = torch.device("cpu")
    assert use_int8("auto", cpu, torch.float32) and use_int8("int8", cpu, torch.float32)
    assert not use_int8("full", cpu, torch.float32)
    assert not use_int8("auto", cpu, torch.float64)  # not the fp32 fast path: full weights
    assert not use_int8("auto", torch.device("cuda"), torch.bfloat16)
    for device, dtype in ((cpu, torch.bfloat16), (torch.device("cuda"), torch.float32)):
        with pytest.raises(ValueError, match="int8 need the drafter on a CPU in float32"):
            use_int8("int8", device, dtype)


def test_engine_config_refuses_an_unknown_weight_setting():
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        EngineConfig(draft_weights="fp8")
    with pytest.raises(ValueError, match="fused mode computes the target"):
        EngineConfig(mode=Mode.FUSED, draft_weights="int8")


def test_int8_drafts_are_close_to_full_precision_ones(fp32_models):
    target, drafter = fp32_models
    full, int8 = DraftRunner(drafter, 1, 64), DraftRunner(drafter, 1, 64, int8=True)
    assert int8.int8 and not full.int8
    for r in (full, int8):
        r.prefill(0, PROMPTS[0])
    pack = extend_pack([30, 31], 4)
    a, b = full.run([(0, pack)])[0], int8.run([(0, pack)])[0]  # [1, 4, V] each
    assert a.shape == b.shape
    assert (a - b).norm() / a.norm() < 0.1
    # The target's own packed weights stay full precision: int8 is the drafter's own copy.
    assert isinstance(drafter.fused_layers(True)[0].qkv, Int8Gated)
    assert isinstance(drafter._int8_head(), Int8Linear)
    assert isinstance(target.fused().layers[0].qkv, PackedLinear)
    assert isinstance(target.fused().lm_head, PackedLinear)


def test_a_drafter_rebuilds_its_int8_copies_for_another_setting(fp32_models):
    """bench_int8_accuracy.py compares settings through `use_int8_setting`, not by patching
    module globals; the service's default is 8-bit activations at this machine's levels."""
    _, drafter = fp32_models
    runner = DraftRunner(drafter, 1, 64, int8=True)
    runner.prefill(0, PROMPTS[1])
    pack = extend_pack([30, 31], 4)
    default = runner.run([(0, pack)])[0]
    assert drafter.int8_setting == Int8Setting() and not drafter._int8_head().reduce_range
    coarse = Int8Setting(levels=3, reduce_range=True)
    drafter.use_int8_setting(coarse)
    try:
        assert drafter._int8_head().reduce_range
        assert drafter.fused_layers(True)[0].qkv.setting == coarse
        runner.reset(0)
        runner.prefill(0, PROMPTS[1])
        assert not torch.allclose(runner.run([(0, pack)])[0], default)  # 3 levels: coarse
    finally:
        drafter.use_int8_setting(Int8Setting())
    runner.reset(0)
    runner.prefill(0, PROMPTS[1])
    assert torch.equal(runner.run([(0, pack)])[0], default)


def _group(out_sizes=(24, 8, 8), k=16, rank=4, seed=0):
    """A fused group of deltas (q/k/v-like) over fresh fp32 Linears, B non-zero."""
    gen = torch.Generator().manual_seed(seed)
    gate = Gate()
    deltas = []
    for n in out_sizes:
        base = torch.nn.Linear(k, n)
        with torch.no_grad():
            base.weight.copy_(torch.randn(n, k, generator=gen))
            base.bias.copy_(torch.randn(n, generator=gen))
        d = LowRankDelta(base, rank, 8.0, gate, gen)
        with torch.no_grad():
            d.delta_b.copy_(torch.randn(n, rank, generator=gen))
        deltas.append(d)
    return tuple(deltas), gate


def _reference(deltas, x, is_mask):
    """The fp32 gated projection: base everywhere, plus the deltas where is_mask."""
    base = torch.cat([m.base(x) for m in deltas], -1)
    delta = torch.cat([m.delta(x) for m in deltas], -1)
    return base + delta * is_mask.unsqueeze(-1)


@pytest.mark.parametrize("pattern", ["none", "all", "run", "scattered"])
def test_int8_gated_projection_matches_the_fp32_one_on_every_gate_path(pattern):
    """Clean rows get the target's projection alone, mask rows the deltas too, whether the
    mask rows are none, all, one run (views) or scattered (gather and scatter)."""
    deltas, gate = _group()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    is_mask = torch.zeros(2, 5, dtype=torch.bool)
    if pattern == "all":
        is_mask[:] = True
    elif pattern == "run":
        is_mask[0, 2:] = True
        is_mask[1, :3] = True
    elif pattern == "scattered":
        is_mask[0, 1] = is_mask[1, 3] = True
    proj = Int8Gated(deltas)
    gate.set(is_mask, torch.float32)
    got = proj(x)
    gate.clear()
    ref = _reference(deltas, x, is_mask.float())
    assert got.shape == (2, 5, 40)
    assert (got - ref).norm() / ref.norm() < 0.05  # 7-bit activations, 8-bit weights
    clean = ~is_mask
    if clean.any():
        plain = torch.cat([m.base(x) for m in deltas], -1)
        assert (got[clean] - plain[clean]).abs().max() < 0.1 * plain.abs().max()


def test_int8_gated_projection_is_rebuilt_when_a_delta_changes():
    deltas, gate = _group()
    x = torch.randn(1, 3, 16)
    proj = Int8Gated(deltas)
    gate.set(torch.ones(1, 3, dtype=torch.bool), torch.float32)
    before = proj(x)
    with torch.no_grad():
        deltas[0].delta_b.mul_(3.0)  # an optimiser step, as far as versions go
    assert torch.equal(proj(x), before)  # a pass does not check: the drafter does, once a pass
    proj.prepare()
    after = proj(x)
    ref = _reference(deltas, x, torch.ones(1, 3))
    gate.clear()
    assert not torch.allclose(before, after)
    assert (after - ref).norm() / ref.norm() < 0.05


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_an_int8_drafter_keeps_the_target_output(fp32_models, mode):
    """Greedy: token for token what plain decoding gives; the drafter does use int8."""
    target, drafter = fp32_models
    params = SamplingParams(max_new_tokens=20, seed=3)

    def run(m: Mode, weights: str):
        cfg = EngineConfig(mode=m, spec=SpecConfig(block_size=4), max_batch_size=3,
                           max_context=96, draft_weights=weights)
        engine = SpecEngine(cfg, target, None if m is Mode.AR else drafter)
        return engine, [o.token_ids for o in generate(engine, PROMPTS, params)]

    _, plain = run(Mode.AR, "auto")
    engine, spec = run(mode, "int8")
    assert engine.drafting.runner.int8
    assert spec == plain


def test_an_int8_runner_follows_deltas_that_training_changed(fp32_models, tiny_pair_dir):
    """Training between passes changes the deltas in place; the next int8 pass uses them."""
    from sglang_d3d.models.drafter import D3DDrafter

    drafter = D3DDrafter.from_pretrained(tiny_pair_dir[1], fp32_models[0])  # its own deltas
    full, int8 = DraftRunner(drafter, 1, 64), DraftRunner(drafter, 1, 64, int8=True)
    pack = extend_pack([30, 31], 4)

    def drafts(r):
        r.reset(0)
        r.prefill(0, PROMPTS[0])
        return r.run([(0, pack)])[0]

    before = drafts(int8)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.mlp.down_proj.delta_b.add_(0.5)
    a, b = drafts(full), drafts(int8)
    assert not torch.allclose(b, before)
    assert (a - b).norm() / a.norm() < 0.1
