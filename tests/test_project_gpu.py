"""benchmarks/project_gpu.py: the roofline cost model and the cycle arithmetic, alone, and the
script's table from the results in the repository (no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import project_gpu as pg  # noqa: E402
from gpu_shapes import SHAPES  # noqa: E402

QWEN = SHAPES["qwen3-8b"]
HW = pg.Hardware("test", bandwidth=1e12, peak_flops=1e14, handover_ms=0.1)


def _acc(**kw) -> pg.Acceptance:
    base = dict(source="f:sync@8", mode="sync", block=8, branches=4, draft_tokens=3.0,
                copy_tokens=2.0, copy_share=0.0, hit_rate=0.0)
    return pg.Acceptance(**{**base, **kw})


def test_qwen3_8b_weights_are_about_15_gb_and_its_kv_147_kb_a_token():
    assert 15.0e9 < pg.weight_bytes(QWEN) < 15.3e9  # 7.57B parameters past the embedding
    assert pg.kv_bytes_per_token(QWEN) == 2 * 36 * 2 * 8 * 128


def test_roofline_is_the_larger_of_memory_and_compute():
    assert pg.roofline_ms(pg.Pass(2e12, 1e12), HW) == pytest.approx(2000.0)  # memory-bound
    assert pg.roofline_ms(pg.Pass(1e9, 1e15), HW) == pytest.approx(10000.0)  # compute-bound


def test_one_token_passes_are_memory_bound_and_wide_ones_compute_bound():
    h200 = pg.H200
    step = pg.forward_pass(QWEN, 1, 1, 512)
    assert step.bytes / h200.bandwidth > step.flops / h200.peak_flops
    wide = pg.forward_pass(QWEN, 64, 8, 512)
    assert wide.flops / h200.peak_flops > wide.bytes / h200.bandwidth


def test_sync_cycle_is_draft_then_verify_and_copies_skip_the_draft():
    c = pg.Costs(ar=1.0, verify=2.0, draft_one=1.5, overlapped=2.5)
    assert pg.tokens_and_ms(_acc(), c, 1) == (3.0, 3.5)
    tokens, ms = pg.tokens_and_ms(_acc(copy_share=0.5), c, 1)
    assert tokens == pytest.approx(2.5) and ms == pytest.approx(2.0 + 0.5 * 1.5)
    assert pg.speedup(_acc(), c, 1) == pytest.approx(3.0 / 3.5)


def test_copies_need_every_row_and_async_misses_any_row():
    assert pg.copy_probability(_acc(copy_share=0.5), 3) == pytest.approx(0.125)
    c = pg.Costs(ar=1.0, verify=2.0, draft_one=1.0, overlapped=2.5)
    hit = _acc(mode="async", hit_rate=1.0)
    assert pg.tokens_and_ms(hit, c, 8)[1] == pytest.approx(2.5)  # every pre-draft held
    half = _acc(mode="async", hit_rate=0.5)
    assert pg.tokens_and_ms(half, c, 2)[1] == pytest.approx(2.5 + 0.75 * 1.0)


def test_one_gpu_shares_the_roofline_and_two_gpus_take_the_longer_pass():
    acc = _acc(mode="async")
    one = pg.costs(QWEN, pg.H200, acc, 1, 512, two_gpus=False)
    two = pg.costs(QWEN, pg.H200, acc, 1, 512, two_gpus=True)
    pre_draft = pg.roofline_ms(pg.forward_pass(QWEN, 1, 8 * 4, 512), pg.H200)  # 4 branches of 8
    assert two.overlapped == pytest.approx(max(two.verify, pre_draft) + pg.H200.handover_ms)
    assert one.overlapped > two.overlapped  # both passes read their weights from one HBM
    assert one.ar == two.ar


def test_measured_times_scale_each_kind_of_pass_and_report_the_error():
    step = pg.roofline_ms(pg.forward_pass(QWEN, 1, 1, 512), pg.H200)
    run = {"ar_step_ms": 2 * step, "verify_ms": {"4": 1.0, "8": 8.0, "16": 9.0},
           "draft_ms": {"1": 4.0, "4": 12.0, "17": 40.0},
           "cycle": {"1": {"async_cycle_ms": 9.0}, "4": {"async_cycle_ms": 15.0}}}
    scale, rows = pg.measured_scale(run, QWEN, pg.H200, 512, block=8, branches=4)
    assert scale.ar == pytest.approx(2.0)
    assert rows[1][2] == 8.0 and rows[2][2] == 12.0 and rows[3][2] == 15.0
    assert pg.error_pct(step, 2 * step) == pytest.approx(-50.0)
    scaled = pg.costs(QWEN, pg.H200, _acc(), 1, 512, two_gpus=False, scale=scale)
    assert scaled.ar == pytest.approx(2 * step)


def test_acceptance_rows_read_cycle_kinds_of_a_bench_file():
    run = {"block_size": 8, "branch_budget": 4, "modes": {
        "ar": {"mean_accepted_length": 1.0},
        "async@8": {"mean_accepted_length": 2.8, "branch_hit_rate": 0.35, "by_kind": {
            "copy": {"cycle_share": 0.7, "tokens_per_cycle": 2.75},
            "draft": {"cycle_share": 0.3, "tokens_per_cycle": 2.98}}}}}
    (row,) = pg.acceptance_rows(run, "x.json")
    assert (row.mode, row.block, row.branches, row.draft_tokens) == ("async", 8, 4, 2.98)
    assert (row.copy_share, row.copy_tokens, row.hit_rate) == (0.7, 2.75, 0.35)


def test_the_script_prints_a_labelled_table_from_the_repository(capsys, tmp_path):
    lines = pg.main(["--measured", str(tmp_path / "absent.json")])
    text = "\n".join(lines)
    assert text.startswith("PROJECTION (not a measurement)")
    assert "roofline only" in text and "sync@8 (a)" in text and "async@8 (b)" in text
    # one table a dataset: the two `d3d bench` runs, then the worker's, one per dataset of
    # benchmarks/results/sglang_cpu.json
    worker = len(pg.worker_acceptance(pg.SGLANG_RUN)) if pg.SGLANG_RUN.is_file() else 0
    assert sum(line.strip().startswith("64 ") for line in lines) == 2 + worker
    assert worker == 0 or "SGLang worker, acceptance from sglang_cpu.json" in text


def test_a_gpu_check_file_calibrates_and_prints_the_error(tmp_path):
    run = {"ar_step_ms": 4.0, "verify_ms": {"8": 5.0}, "draft_ms": {"4": 12.0},
           "cycle": {"4": {"async_cycle_ms": 15.0}}}
    f = tmp_path / "gpu_check.json"
    f.write_text(json.dumps({"shapes": {"qwen3-8b": run}}))
    text = "\n".join(pg.main(["--measured", str(f)]))
    assert "roofline scaled by gpu_check.json" in text
    assert "measured    4.00 ms" in text and "async cycle 4 br." in text


def test_accepted_length_within_a_width_counts_its_drafts_and_the_emitted_token():
    pos = [1.0, 0.7, 0.4, 0.1]  # bench_accept.py's by_position at block 5
    assert pg.tokens_within(pos, 5) == pytest.approx(3.2)
    assert pg.tokens_within(pos, 3) == pytest.approx(2.7)
    assert pg.tokens_within(pos, 1) == 1.0


def test_the_worker_table_reads_bench_sglang_and_models_eager_and_one_pass(tmp_path):
    run = {"args": {"block": 4}, "results": {
        "gsm8k": {"1": {"per_cycle": {"spec_accepted_length": 2.5, "accepted_length": 1.7}}},
        "mbpp": {"8": {"per_cycle": {"accepted_length": 2.0}}}}}
    path = tmp_path / "sglang_cpu.json"
    path.write_text(json.dumps(run))
    assert pg.worker_acceptance(path) == [("gsm8k", 4, 2.5)]  # concurrency 1 only
    # a run that mixed plain cycles in: 25% plain at 1 token, the rest at 3 -> 2.5 on average
    assert pg.spec_tokens({"accepted_length": 2.5, "plain_share": 0.25}) == pytest.approx(3.0)
    c = pg.worker_cycles(QWEN, pg.H200, 4, 1, 512)
    # at batch 1 every pass reads the weights once: the worker's two eager passes cost about
    # two steps plus launches, the one-pass cycle about one step
    assert c["worker"] == pytest.approx(2 * c["step"] + 2 * pg.eager_ms(QWEN), rel=0.05)
    assert c["one_pass"] < 1.2 * c["step"]
    lines = pg.worker_table(QWEN, pg.H200, pg.worker_acceptance(path), 512)
    assert any(line.startswith("    1 ") for line in lines)
