"""`d3d prune` on a tiny pair: the table is written, and a pruned checkpoint decodes losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_hf_model
from sglang_d3d.testing import make_tiny_target
from sglang_d3d.training.datagen import DatagenConfig, run_datagen_config
from sglang_d3d.training.prune import PruneConfig, Pruner, least_useful
from sglang_d3d.training.prune_report import pick_depth


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune")
    target = make_tiny_target(root / "target")
    gsm = root / "train.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"w{5 + i} w{9 + i}"}) + "\n" for i in range(20)))
    run_datagen_config(DatagenConfig(out_dir=str(root / "data"), target_path=target,
                                     gsm8k_path=str(gsm), max_prompts=16, shard_size=8,
                                     batch_size=8, max_new_tokens=16))
    dec = Decoder.from_hf(load_hf_model(root / "target"))
    full = D3DDrafter.init_from_target(dec, [0, 2, 3], block_size=4, rank=4, alpha=4.0)
    with torch.no_grad():
        for p in full.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.02)
    full.save_pretrained(root / "full")
    cfg = PruneConfig(drafter_path=str(root / "full"), data_dir=str(root / "data"),
                      out_dir=str(root / "run"), results_dir=str(root / "results"),
                      target_path=target, min_layers=1, eval_samples=4, heldout_every=4,
                      score_samples=2, recover_steps=2, batch_size=2, e2e_prompts=1,
                      e2e_max_new_tokens=8)
    rows = Pruner(cfg).run()
    return root, rows, cfg


def test_prune_table_covers_every_depth(pruned):
    root, rows, _ = pruned
    assert [r["depth"] for r in rows] == [3, 2, 1]
    assert len(rows[2]["removed_source_layers"]) == 2
    assert all(r["draft_s_per_branch_batch"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    for r in rows:  # the better of the two speculative modes, with plain decoding beside it
        assert r["tokens_per_s"] == max(r["sync_tokens_per_s"], r["async_tokens_per_s"])
        assert r["ar_tokens_per_s"] > 0
    table = json.loads((root / "results" / "prune_table.json").read_text())
    assert table["choice"]["depth"] in (1, 2, 3)
    assert "| depth |" in (root / "results" / "prune_table.md").read_text()
    assert (root / "results" / "prune_plot.png").stat().st_size > 0


def test_pruned_checkpoint_loads_and_decodes_losslessly(pruned):
    root, _, _ = pruned
    dec = Decoder.from_hf(load_hf_model(root / "target"))
    drafter = D3DDrafter.from_pretrained(root / "run" / "depth_1", dec)
    assert drafter.num_layers == 1 and len(drafter.cfg.source_layers) == 1
    prompts = [[5, 9, 7, 3], [11, 12, 3]]
    params = SamplingParams(max_new_tokens=12)
    outs = {}
    for mode in (Mode.AR, Mode.ASYNC):
        cfg = EngineConfig(mode=mode, spec=SpecConfig(block_size=4), max_batch_size=2,
                           max_context=64)
        outs[mode] = [o.token_ids for o in generate(SpecEngine(cfg, dec, drafter), prompts, params)]
    assert outs[Mode.ASYNC] == outs[Mode.AR]
    assert all(len(o) > 0 for o in outs[Mode.AR])


def test_pick_depth_prefers_end_to_end_speed_then_acceptance():
    rows = [{"depth": 4, "accept_len": 3.0, "tokens_per_s": 10.0},
            {"depth": 3, "accept_len": 2.99, "tokens_per_s": 12.0},
            {"depth": 2, "accept_len": 2.5, "tokens_per_s": 11.0}]
    assert pick_depth(rows)["depth"] == 3
    no_e2e = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
    assert pick_depth(no_e2e)["depth"] == 3


def test_least_useful_takes_the_cheapest_removals():
    assert least_useful({0: 2.0, 1: 3.5, 2: 3.5, 3: 1.0}, 1) == [2]  # ties: the later layer
    assert least_useful({0: 2.0, 1: 3.5, 2: 3.0, 3: 1.0}, 2) == [1, 2]


def test_a_rerun_continues_after_the_last_finished_round(pruned):
    """A run stopped after round 1 (its table saved at depth 2) resumes from depth_2's
    checkpoint, keeps the finished rows and removes exactly one more layer."""
    root, rows, cfg = pruned
    (root / "run" / "prune_rows.json").write_text(json.dumps(rows[:2]))
    again = Pruner(cfg).run()
    assert [r["depth"] for r in again] == [3, 2, 1]
    assert again[:2] == rows[:2]  # the finished rounds are not redone
    assert set(again[1]["removed_source_layers"]) < set(again[2]["removed_source_layers"])


def test_remeasure_re_times_every_depth_and_keeps_acceptance(pruned):
    root, rows, cfg = pruned
    import dataclasses

    again = Pruner(dataclasses.replace(cfg, remeasure=True)).remeasure()
    assert [r["depth"] for r in again] == [r["depth"] for r in rows]
    assert [r["accept_len"] for r in again] == [r["accept_len"] for r in rows]
    assert all(r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0 for r in again)
    saved = json.loads((root / "run" / "prune_rows.json").read_text())
    assert [r["sync_tokens_per_s"] for r in saved] == [r["sync_tokens_per_s"] for r in again]


def test_remeasure_without_a_run_says_so(pruned, tmp_path):
    import dataclasses

    _, _, cfg = pruned
    with pytest.raises(FileNotFoundError, match="run d3d prune without --remeasure first"):
        Pruner(dataclasses.replace(cfg, out_dir=str(tmp_path / "none"), remeasure=True)).remeasure()
