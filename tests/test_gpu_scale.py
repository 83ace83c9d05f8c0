"""benchmarks/gpu_scale.py runs end to end on CPU (--device cpu --tiny), and its projection is
the documented formula. The GPU numbers themselves come from benchmarks/gpu_check.sh."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_report  # noqa: E402
import gpu_scale  # noqa: E402


def test_the_whole_check_runs_on_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "gpu_scale.json"
    gpu_scale.main(["--device", "cpu", "--tiny", "--shapes", "qwen3-8b", "--out", str(out)])
    saved = json.loads(out.read_text())
    shape = saved["shapes"]["qwen3-8b"]
    assert shape["shape"]["family"] == "qwen3" and shape["ar_step_ms"] > 0
    assert sorted(shape["verify_ms"]) == ["16", "4", "8"]
    assert sorted(shape["draft_ms"]) == ["1", "17", "4"]
    fused = {(r["block"], r["branches"]): r["ms"] for r in shape["fused"]}
    assert sorted(fused) == [(4, 1), (8, 2), (16, 4), (16, 16)]
    assert all(ms > 0 for ms in fused.values())
    for c in shape["cycle"].values():
        assert c["async_cycle_ms"] > 0 and c["cycle_over_max"] > 0
    (proj, *_) = saved["projection"]["qwen3-8b"]
    assert "PROJECTION" in proj["label"] and proj["projected_speedup"] > 0


def test_projection_is_the_documented_formula():
    shape = {
        "ar_step_ms": 10.0,
        "draft_ms": {1: 4.0, 4: 6.0},
        "cycle": {1: {"async_cycle_ms": 11.0}, 4: {"async_cycle_ms": 12.0}},
    }
    acc = dict(source="x.json", dataset="d", branch_budget=4, mean_accepted_length=2.0,
               branch_hit_rate=0.25)  # fmt: skip
    p = gpu_report.project(shape, acc)
    # cycle = 0.25 * 12 + 0.75 * (12 + 4) = 15; speedup = 2.0 * 10 / 15
    assert p["branches"] == 4 and p["projected_cycle_ms"] == pytest.approx(15.0)
    assert p["projected_speedup"] == pytest.approx(20.0 / 15.0)


def test_sync_and_fused_projections():
    shape = {
        "ar_step_ms": 10.0,
        "verify_ms": {4: 11.0, 8: 12.0},
        "draft_ms": {1: 4.0, 4: 6.0},
        "fused": [{"block": 4, "branches": 1, "ms": 13.0}, {"block": 8, "branches": 2, "ms": 15.0},
                  {"block": 16, "branches": 1, "ms": 20.0}],
        "cycle": {1: {"async_cycle_ms": 11.0}},
    }
    base = dict(dataset="d", branch_budget=1, branch_hit_rate=0.7)  # fmt: skip
    sync = gpu_report.project(shape, dict(base, source="s", mode="sync", block=8,
                                          mean_accepted_length=2.8))
    assert sync["projected_cycle_ms"] == pytest.approx(4.0 + 12.0)  # a draft, then a verify
    fused = gpu_report.project(shape, dict(base, source="f", mode="fused", block=4,
                                           mean_accepted_length=1.5))
    assert fused["projected_cycle_ms"] == pytest.approx(13.0)  # one pass: verify 4 + 1 branch
    assert fused["projected_speedup"] == pytest.approx(1.5 * 10.0 / 13.0)


def test_acceptance_sources_read_fixed_plans_only(tmp_path):
    run = {"dataset": "gsm8k", "block_size": 8, "branch_budget": 1, "modes": {
        "ar": {"mean_accepted_length": 1.0},
        "sync@8": {"mean_accepted_length": 2.8},
        "async-adaptive@8": {"mean_accepted_length": 2.6, "branch_hit_rate": 0.2},
        "fused@4": {"mean_accepted_length": 1.5, "branch_hit_rate": 0.7},
        "async": {"mean_accepted_length": 2.7, "branch_hit_rate": 0.1},
    }}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(run))
    got = {(a["mode"], a["block"]) for a in gpu_report.acceptance_sources([str(f)])}
    assert got == {("sync", 8), ("fused", 4), ("async", 8)}


def test_a_row_split_by_kind_projects_its_drafting_cycles_alone(tmp_path):
    """Cycles of copies skip the drafter: their tokens must not be priced with a draft pass."""
    row = {"mean_accepted_length": 2.8, "by_kind": {
        "copy": {"tokens_per_cycle": 2.7}, "draft": {"tokens_per_cycle": 3.3}}}
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"dataset": "gsm8k", "modes": {"sync@8": row,
                                                            "sync@4": {"mean_accepted_length": 2.5}}}))
    got = {a["block"]: a["mean_accepted_length"] for a in gpu_report.acceptance_sources([str(f)])}
    assert got == {8: 3.3, 4: 2.5}  # the older row, without kinds, keeps its mean
