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
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.int8_linear import Int8Linear, quantize_rows, use_int8
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
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (3,)
    assert q[0].tolist() == [64, -127, 32] and q[2, 0] == 127  # each row's largest -> +-127
    assert scale[1] == 1.0 and q[1].abs().sum() == 0  # a zero row stays zero
    err = (q.double() * scale[:, None] - w.double()).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-12).all())


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
    # The target's own packed weights stay full precision: int8 is a copy beside them.
    assert target.fused(False).lm_head is not target.fused(True).lm_head
    assert not isinstance(target.fused().layers[0].qkv, Int8Linear)


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
