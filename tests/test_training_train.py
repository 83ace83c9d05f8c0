"""`d3d train` on tiny data: checkpoints load in the engine's loader, training resumes."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_hf_model
from sglang_d3d.testing import make_tiny_target
from sglang_d3d.training.datagen import DatagenConfig, run_datagen_config
from sglang_d3d.training.evaluate import accepted_lengths
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


def _cfg(root, target, **kw):
    base = dict(data_dir=str(root / "data"), out_dir=str(root / "run"), target_path=target,
                layers=(0, 3), block_size=4, num_anchors=3, ar_positions=4, head_size=40,
                batch_size=4, max_steps=4, warmup_steps=2, eval_every=2, heldout_every=4,
                eval_samples=6, bf16=False)
    return TrainConfig(**{**base, **kw})


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    timed = TrainConfig(lr=1.0, warmup_steps=4, max_steps=1000, min_lr_ratio=0.1,
                        time_budget_min=1.0)
    assert lr_at(9, timed, elapsed_s=30.0) == pytest.approx(0.55)  # half the time budget
    assert lr_at(9, timed, elapsed_s=90.0) == pytest.approx(0.1)


def test_accepted_lengths_count_leading_matches_plus_one():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    truth = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert accepted_lengths(drafts, truth).tolist() == [4, 2, 1]


def test_train_checkpoints_load_and_resume(tiny_data):
    root, target = tiny_data
    final = Trainer(_cfg(root, target, export_to=str(root / "export"))).run()
    assert 1.0 <= final["accept_len"] <= 4.0 and final["step"] == 4
    dec = Decoder.from_hf(load_hf_model(root / "target"))
    loaded = D3DDrafter.from_pretrained(root / "export", dec)
    assert loaded.cfg.block_size == 4 and loaded.cfg.source_layers == (0, 3)
    assert loaded.head_ids is not None and loaded.head_ids.numel() == 40
    assert 2 in loaded.head_ids.tolist()  # EOS is always in the restricted head
    resumed = Trainer(_cfg(root, target, max_steps=6))
    assert resumed.step == 4
    assert torch.equal(resumed.drafter.head_ids, loaded.head_ids)
    assert resumed.run()["step"] == 6
    steps = [json.loads(x)["step"] for x in (root / "run" / "history.jsonl").read_text().splitlines()]
    assert max(steps) == 6
