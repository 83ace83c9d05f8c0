"""`d3d train` settings and outputs: --config files, the drafter folder's model card, the
TensorBoard log, mixed precision with fp32 master weights, gradient checkpointing."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from train_helpers import write_random_data

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_hf_model
from sglang_d3d.testing import make_tiny_target
from sglang_d3d.training.train import TrainConfig, Trainer, main
from sglang_d3d.training.train_args import add_train_args, config_from_args

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
TINY = dict(block_size=4, num_anchors=3, rank=4, alpha=4.0, batch_size=4, max_steps=2,
            warmup_steps=1, eval_every=100, eval_samples=4, heldout_every=4, lr=1e-2,
            initial_eval=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    make_tiny_target(root / "target")
    write_random_data(root / "data")
    return root


def _cfg(root: Path, out: str, **kw) -> TrainConfig:
    return TrainConfig(data_dir=str(root / "data"), target_path=str(root / "target"),
                       out_dir=str(root / out), **{**TINY, **kw})


def _parse(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(argv))


def test_a_config_file_fills_the_flags_left_out_and_the_command_line_wins(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("max-steps: 7\nblock_size: 8\nlr: 1e-3\nlayers: [0, 1]\nfsdp: true\n"
                 "max-seq-len: 1024\ntarget: models/t\n")
    cfg = _parse(["--config", str(f), "--lr", "5e-4", "--no-fsdp"])
    assert (cfg.max_steps, cfg.block_size, cfg.layers, cfg.max_seq_len) == (7, 8, (0, 1), 1024)
    assert cfg.target_path == "models/t"  # --target, the alias of --target-path
    assert cfg.lr == 5e-4 and not cfg.fsdp  # given on the command line, even at the default


def test_an_unknown_config_key_is_a_one_line_error(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("max-steps: 7\nmax-stepz: 3\n")
    assert main(["--config", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown key 'max-stepz'" in err


@pytest.mark.parametrize("name", ["qwen3-8b-8gpu", "llama3.1-8b-8gpu", "smollm2-135m-cpu"])
def test_the_shipped_configs_read(name):
    cfg = _parse(["--config", str(CONFIGS / f"{name}.yaml")])
    assert cfg.block_size == 16 and cfg.min_block_size == 4
    assert (cfg.device == "cuda") == name.endswith("8gpu")


def test_a_sequence_length_beyond_the_targets_context_is_refused(tiny):
    with pytest.raises(ValueError, match="beyond the target's context"):
        Trainer(_cfg(tiny, "long", max_seq_len=100_000))


def test_the_drafter_folder_carries_a_model_card_and_the_run_a_tensorboard_log(tiny):
    export = tiny / "export"
    final = Trainer(_cfg(tiny, "card", export_to=str(export))).run()
    card = (export / "README.md").read_text()
    dec = Decoder.from_hf(load_hf_model(tiny / "target"))
    drafter = D3DDrafter.from_pretrained(export, dec)
    assert drafter.cfg.target_fingerprint in card  # the target
    assert str(tiny / "target") in card
    assert "random test data" in card and "Samples: 40" in card  # the data, from the manifest
    assert "| source 0 |" not in card and "GSM8K" in card  # the prompt mix, by source
    assert "Steps: 2 of 2" in card and "lr 0.01" in card  # the schedule
    assert f"**{final['accept_len']:.3f}**" in card  # held-out acceptance, per position
    assert all(f"| {d} | {p:.3f} |" in card for d, p in enumerate(final["by_position"], 1))
    assert f"d3d serve --target {tiny / 'target'} --drafter {export}" in card
    assert f"--speculative-draft-model-path {export}" in card and "sglang.launch_server" in card
    assert (tiny / "card" / "drafter" / "README.md").exists()
    events = list((tiny / "card" / "tensorboard").glob("events.out.tfevents.*"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert not events
    else:
        assert events


def test_a_bf16_target_trains_fp32_master_weights_under_autocast(tiny):
    t = Trainer(_cfg(tiny, "bf16", dtype="bfloat16", tensorboard=False))
    assert t.target.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in t.drafter.trainable_parameters())
    final = t.run()
    assert final["step"] == 2 and 1.0 <= final["accept_len"] <= 4.0
    assert all(p.dtype == torch.float32 for p in t.drafter.trainable_parameters())


def test_gradient_checkpointing_takes_the_same_steps(tiny):
    plain = Trainer(_cfg(tiny, "plain", tensorboard=False))
    plain.run()
    ckpt = Trainer(_cfg(tiny, "ckpt", grad_checkpointing=True, tensorboard=False))
    ckpt.run()
    a, b = plain.drafter.own_state(), ckpt.drafter.own_state()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_log_rows_become_tensorboard_tags():
    from sglang_d3d.training.run_log import scalars

    train = scalars({"step": 10, "loss": 2.5, "acc2": 0.5, "lr": 1e-3, "elapsed_s": 4.0})
    assert train == {"train/loss": 2.5, "train/acc2": 0.5, "train/lr": 1e-3,
                     "train/elapsed_s": 4.0}
    ev = scalars({"step": 10, "accept_len": 2.0, "by_source": {"0": 2.1},
                  "by_position": [1.0, 0.5], "num_blocks": 8})
    assert ev == {"eval/accept_len": 2.0, "eval/accept_len_source_0": 2.1,
                  "eval/accept_pos_1": 1.0, "eval/accept_pos_2": 0.5, "eval/num_blocks": 8.0}


def test_a_target_with_a_sliding_window_trains_inside_it():
    from sglang_d3d.training.train_config import seq_len_for

    cfg = TrainConfig(data_dir="d")
    assert seq_len_for(cfg, 32_768, 4_096) == 4_096  # full attention equals windowed inside it
    assert seq_len_for(cfg, 32_768, None) == 32_768
    assert seq_len_for(TrainConfig(data_dir="d", max_seq_len=1_024), 32_768, 4_096) == 1_024
    with pytest.raises(ValueError, match="beyond the target's attention window"):
        seq_len_for(TrainConfig(data_dir="d", max_seq_len=8_192), 32_768, 4_096)


def test_held_out_samples_are_cropped_as_training_reads_them():
    import numpy as np

    from sglang_d3d.training.shards import Sample, crop

    s = Sample(np.arange(5), np.arange(5, 10), source=1, prompt_index=3)
    assert crop(s, 7).ids.tolist() == list(range(7)) and len(crop(s, 7).prompt) == 5
    assert crop(s, 3).ids.tolist() == [0, 1, 2] and crop(s, 3).response.size == 0
    assert crop(s, 50).ids.tolist() == list(range(10)) and crop(s, 7).source == 1


def test_the_cards_commands_name_the_device_it_was_trained_on():
    from sglang_d3d.training.model_card import CardFacts, _serve_lines

    facts = CardFacts(target="T", model_type="llama", num_layers=2, vocab_size=10,
                      fingerprint="f", source_layers=(0,), config={"block_size": 4,
                      "device": "cpu"}, world=1, step=0, elapsed_s=0.0, data={},
                      evaluation=None)
    cpu = "\n".join(_serve_lines(facts, "D"))
    assert "d3d serve --target T --drafter D --block-size 4" in cpu
    gpu = "\n".join(_serve_lines(replace(facts, config={"block_size": 4, "device": "cuda:1"}), "D"))
    assert "d3d serve --target T --drafter D --device cuda --block-size 4" in gpu
    default = "\n".join(_serve_lines(replace(facts, default_target=True), "D"))
    assert "d3d serve --drafter D" in default and "--model-path T" not in default
    assert "default_target_path()" in default  # SGLang gets the local folder, not a hub id


def test_a_run_logs_its_final_evaluation_once_and_says_where_the_drafter_went(tiny, capsys):
    import json
    import stat

    out, export = tiny / "once", tiny / "once_export"
    # the last step is an evaluation step: the final evaluation is that one, not a second
    argv = ["--data-dir", str(tiny / "data"), "--target", str(tiny / "target"),
            "--out-dir", str(out), "--export-to", str(export), "--block-size", "4",
            "--num-anchors", "3", "--rank", "4", "--alpha", "4", "--batch-size", "4",
            "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "2",
            "--eval-samples", "4", "--heldout-every", "4", "--no-initial-eval"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    evals = [line for line in printed.out.splitlines() if '"accept_len"' in line]
    assert len(evals) == 1 and json.loads(evals[0])["step"] == 2
    history = (out / "history.jsonl").read_text().splitlines()
    assert sum('"accept_len"' in r for r in history) == 1
    assert (f"d3d train: step 2: the drafter is in {export} (and in {out / 'drafter'})"
            in printed.err)
    for folder in (out / "drafter", export):  # readable by whoever serves it
        mode = stat.S_IMODE((folder / "model.safetensors").stat().st_mode)
        assert mode & 0o044 == 0o044, oct(mode)


def test_under_torchrun_only_the_first_process_prints_a_refusal(tmp_path, capsys, monkeypatch):
    f = tmp_path / "run.yaml"
    f.write_text("max-stepz: 3\n")
    monkeypatch.setenv("RANK", "1")
    assert main(["--config", str(f)]) == 2
    assert capsys.readouterr().err == ""  # rank 0 says it, once
    monkeypatch.setenv("RANK", "0")
    assert main(["--config", str(f)]) == 2
    assert "unknown key 'max-stepz'" in capsys.readouterr().err
