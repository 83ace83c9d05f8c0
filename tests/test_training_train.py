"""`d3d train` on tiny data: checkpoints load in the engine's loader, training resumes."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.models.acceptance import conditional_rates
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_hf_model
from sglang_d3d.testing import make_tiny_target
from sglang_d3d.training.datagen import DatagenConfig, run_datagen_config
from sglang_d3d.training.evaluate import accepted_lengths
from sglang_d3d.training.forward import clean_pass
from sglang_d3d.training.objective import IGNORE
from sglang_d3d.training.train import TrainConfig, Trainer, lr_at


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target")
    gsm = root / "train.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"w{5 + i} w{9 + i}"}) + "\n" for i in range(30)))
    run_datagen_config(DatagenConfig(out_dir=str(root / "data"), target_path=target,
                                     gsm8k_path=str(gsm), max_prompts=24, shard_size=8,
                                     batch_size=8, max_new_tokens=16))
    return root, target


def _cfg(root, target, out="run", **kw):
    base = dict(data_dir=str(root / "data"), out_dir=str(root / out), target_path=target,
                block_size=4, num_anchors=3, rank=4, alpha=4.0, batch_size=4, max_steps=4,
                warmup_steps=2, eval_every=2, heldout_every=4, eval_samples=6, lr=1e-2)
    return TrainConfig(**{**base, **kw})


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)


def test_accepted_lengths_count_leading_matches_plus_one():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    truth = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert accepted_lengths(drafts, truth).tolist() == [4, 2, 1]


def test_train_checkpoints_load_in_the_engine_loader(tiny_data):
    root, target = tiny_data
    final = Trainer(_cfg(root, target, export_to=str(root / "export"))).run()
    assert 1.0 <= final["accept_len"] <= 4.0 and final["step"] == 4
    assert len(final["by_position"]) == 3
    dec = Decoder.from_hf(load_hf_model(root / "target"))
    loaded = D3DDrafter.from_pretrained(root / "export", dec)
    assert loaded.cfg.block_size == 4 and loaded.is_full_depth
    # the last held-out evaluation travels with the weights: the controller's prior
    assert loaded.accept_prior == conditional_rates(final["by_position"], final["num_blocks"])


def test_confidence_weights_keep_every_first_slot_and_score_the_kept_rows(tiny_data):
    root, target = tiny_data
    tr = Trainer(_cfg(root, target, out="conf", slot_weights="confidence"))
    batch = next(tr._micro_batches())
    past, clean_h = clean_pass(tr.drafter, batch)
    sel, teacher = tr.loss_rows(batch, clean_h)
    labelled = batch["labels"] != IGNORE
    first = labelled & (batch["slot_draft"] == 2)
    assert first.any() and sel[first].all()  # draft 2 weighs 1: nothing before it can miss
    assert torch.equal(teacher, tr.teacher_logits(batch, clean_h, sel))
    final = tr.run()
    assert final["step"] == 4 and 1.0 <= final["accept_len"] <= 4.0


def test_an_unknown_slot_weighting_is_refused():
    with pytest.raises(ValueError, match="--slot-weights must be one of position, confidence"):
        TrainConfig(slot_weights="uniform")


def _own(trainer):
    return {k: v.detach().clone() for k, v in trainer.drafter.own_state().items()}


def test_a_resumed_run_continues_schedule_data_and_rng_exactly(tiny_data):
    """Stopping after the first step of a session and resuming gives the very weights of an
    uninterrupted run: same schedule, same batches, same sampled loss rows."""
    root, target = tiny_data
    straight = Trainer(_cfg(root, target, out="straight", max_steps=5, eval_every=100))
    straight.run()
    first = Trainer(_cfg(root, target, out="split", max_steps=5, eval_every=100,
                         max_minutes=1e-6))
    assert first.run() == {"step": 1, "stopped": "max_minutes"}
    again = Trainer(_cfg(root, target, out="split", max_steps=5, eval_every=100))
    assert again.step == 1 and again.pos.batch == 1
    assert again.opt.param_groups[0]["lr"] == first.opt.param_groups[0]["lr"]  # no re-warm-up
    again.run()
    want = _own(straight)
    assert all(torch.allclose(v, want[k], atol=1e-6) for k, v in _own(again).items())


def test_resume_from_the_committed_meta_keeps_step_and_data_position(tiny_data):
    root, target = tiny_data
    Trainer(_cfg(root, target, out="meta", max_steps=3, eval_every=100)).run()
    (root / "meta" / "trainer_state.pt").unlink()  # what a fresh clone has: drafter/ + meta
    resumed = Trainer(_cfg(root, target, out="meta", max_steps=5, eval_every=100))
    assert resumed.step == 3 and resumed.pos.batch == 3
    assert resumed.run()["step"] == 5
    steps = [json.loads(x)["step"] for x in (root / "meta" / "history.jsonl").read_text().splitlines()]
    assert max(steps) == 5


def test_mixed_block_training_records_its_smallest_block(tiny_data):
    root, target = tiny_data
    final = Trainer(_cfg(root, target, out="mixed", min_block_size=2, max_steps=2)).run()
    assert "accept_len_b2" in final
    dec = Decoder.from_hf(load_hf_model(root / "target"))
    d = D3DDrafter.from_pretrained(root / "mixed" / "drafter", dec)
    assert d.cfg.smallest_block == 2 and d.cfg.block_size == 4


def test_sigterm_stops_after_the_step_and_saves(tiny_data):
    import os
    import signal

    root, target = tiny_data
    t = Trainer(_cfg(root, target, out="sig", max_steps=50, eval_every=1000))
    real = t.train_step

    def step_then_signal(batches):
        row = real(batches)
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    t.train_step = step_then_signal
    assert t.run() == {"step": 2, "stopped": "signal"}
    assert Trainer(_cfg(root, target, out="sig", max_steps=50)).step == 2


def test_stop_at_step_keeps_the_long_schedule(tiny_data):
    """An equal-step comparison arm stops at its step with the learning rate the full
    schedule has there (not a schedule squeezed into the shorter run)."""
    root, target = tiny_data
    arm = Trainer(_cfg(root, target, out="arm", max_steps=50, warmup_steps=1, eval_every=100,
                       stop_at_step=2))
    assert arm.run() == {"step": 2, "stopped": "stop_at_step"}
    # its last update (step index 1) used the 50-step schedule's rate
    assert arm.opt.param_groups[0]["lr"] == pytest.approx(lr_at(1, arm.cfg))
    assert lr_at(2, arm.cfg) > lr_at(49, arm.cfg)
    assert Trainer(_cfg(root, target, out="arm", max_steps=50, warmup_steps=1)).step == 2


def test_an_arm_sharing_its_start_can_skip_the_initial_evaluation(tiny_data):
    root, target = tiny_data
    Trainer(_cfg(root, target, out="noeval", max_steps=50, eval_every=1, stop_at_step=1,
                 initial_eval=False)).run()
    rows = [json.loads(x) for x in (root / "noeval" / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "accept_len" in r] == [1]  # its own, not step 0
