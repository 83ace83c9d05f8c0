"""The drafter's recorded held-out acceptance (models/acceptance.py) and its way into the
engine's controller."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine

from sglang_d3d.config import Mode
from sglang_d3d.models.acceptance import (
    ACCEPTANCE,
    conditional_rates,
    read_accept_prior,
    write_acceptance,
)
from sglang_d3d.training.checkpoint import export


def test_conditional_rates_divide_the_survival_curve_with_a_count_prior():
    # 100 blocks: all accept draft 1, 60 draft 2, 30 draft 3, none draft 4
    rates = conditional_rates([1.0, 0.6, 0.3, 0.0], 100)
    assert rates == pytest.approx([101 / 102, 61 / 102, 31 / 62, 1 / 32], abs=1e-4)
    assert conditional_rates([0.0, 0.0], 10)[1] == 0.5  # never reached: 0.5, not 0/0


def test_write_read_and_export_keep_the_record(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).write_text("x")
    assert read_accept_prior(src) == ()  # nothing recorded: no prior
    write_acceptance(src, {"step": 7, "accept_len": 2.0, "by_position": [1.0, 0.5], "num_blocks": 40,
                           "by_source": {"0": 2.0}})
    export(src, dst)
    assert (dst / ACCEPTANCE).exists()
    assert read_accept_prior(dst) == conditional_rates([1.0, 0.5], 40)


def test_the_engine_controller_starts_from_the_drafters_prior(tiny_models):
    drafter = tiny_models[2]
    old, drafter.accept_prior = drafter.accept_prior, (0.9, 0.7, 0.5)
    try:
        sync = make_engine(tiny_models, Mode.SYNC, adaptive=True)
        assert sync.controller.prior == (0.9, 0.7, 0.5)
    finally:
        drafter.accept_prior = old


def test_fused_drafts_do_not_take_the_separate_drafters_prior(tiny_prod_models):
    drafter = tiny_prod_models[2]
    old, drafter.accept_prior = drafter.accept_prior, (0.9, 0.7, 0.5)
    try:
        fused = make_engine(tiny_prod_models, Mode.FUSED, adaptive=True)
        assert fused.controller.prior == ()
    finally:
        drafter.accept_prior = old


@pytest.mark.parametrize("text", ["{not json", '{"by_position": [1.0]}', '{"by_position": "x", "num_blocks": 4}'])
def test_a_broken_record_is_refused_with_its_path(tmp_path, text):
    (tmp_path / ACCEPTANCE).write_text(text)
    with pytest.raises(ValueError, match="not a held-out evaluation record"):
        read_accept_prior(tmp_path)
