"""Paired ratios between serving modes (benchmarks/paired.py): pure arithmetic."""

from __future__ import annotations

import math

import pytest
from sglang_d3d.benchmarks.paired import paired_ratios, ratio_summary


def test_ratio_summary_is_a_geometric_mean_with_its_spread():
    s = ratio_summary([1.0, 1.21])
    assert s["ratio"] == pytest.approx(1.1)
    assert (s["low"], s["high"], s["rounds"]) == (1.0, 1.21, 2)
    logs = [0.0, math.log(1.21)]
    assert s["sem"] == pytest.approx(abs(logs[1] - logs[0]) / 2)  # sd / sqrt(2), sd = |d| / sqrt(2)
    one = ratio_summary([0.97])
    assert one["ratio"] == pytest.approx(0.97) and one["sem"] is None


def test_each_round_is_compared_with_the_base_of_the_same_round():
    def row(mode, k, tok, conc=4):
        return {"mode": mode, "round": k, "dataset": "d", "concurrency": conc, "variant": "plain",
                "output_throughput": tok, "tpot_ms": {"mean": 10.0}, "ttft_ms": None}

    rows = [row("ar", 0, 100), row("async", 0, 90), row("ar", 1, 50), row("async", 1, 50),
            row("async", 2, 70),  # no base in round 2: left out
            row("ar", 0, 10, conc=16), row("async", 0, 12, conc=16)]
    by_conc = {e["concurrency"]: e for e in paired_ratios(rows, "ar")}
    assert by_conc[4]["tok_s"]["rounds"] == 2
    assert by_conc[4]["tok_s"]["ratio"] == pytest.approx(math.sqrt(0.9))
    assert by_conc[16]["tok_s"]["ratio"] == pytest.approx(1.2)
    assert by_conc[4]["tpot_mean"]["ratio"] == pytest.approx(1.0)
    assert by_conc[4]["ttft_mean"] is None


def test_the_plain_step_ratio_separates_a_servers_speed_from_its_mode():
    """Both servers decode plainly: the mode's 10% fewer tok/s are its slower plain steps."""
    def row(mode, k, tok, plain_ms):
        return {"mode": mode, "round": k, "dataset": "d", "concurrency": 4, "variant": "plain",
                "output_throughput": tok, "plans": {"1": {"cycles": 60, "mean_ms": plain_ms}}}

    rows = [row("ar", 0, 100, 50.0), row("async", 0, 90, 55.0),
            row("ar", 1, 100, 50.0), row("async", 1, 100, 50.0)]
    (e,) = paired_ratios(rows, "ar")
    assert e["plain_step"]["ratio"] == pytest.approx(math.sqrt(1.1))
    assert e["tok_s_equal_plain"]["low"] == pytest.approx(0.99)  # 0.9 x 1.1
    assert e["tok_s_equal_plain"]["rounds"] == 2


def test_no_plain_cycles_no_equal_plain_figure():
    rows = [{"mode": m, "round": 0, "dataset": "d", "concurrency": 1, "variant": "plain",
             "output_throughput": t, "plans": p}
            for m, t, p in (("ar", 10, {"1": {"cycles": 9, "mean_ms": 40.0}}),
                            ("async", 15, {"4": {"cycles": 9, "mean_ms": 80.0}}))]
    (e,) = paired_ratios(rows, "ar")
    assert e["tok_s"]["ratio"] == pytest.approx(1.5)
    assert e["plain_step"] is None and e["tok_s_equal_plain"] is None


def test_plain_steps_are_compared_at_the_loads_batch_bucket_where_labelled():
    """ar's plain cycles at 1-2 rows (a load's tail) make its mean cheaper than async's, which
    speculates there: the bucket of the load's concurrency compares like with like."""
    def row(mode, all_ms, at4_ms):
        return {"mode": mode, "round": 0, "dataset": "d", "concurrency": 4, "variant": "plain",
                "output_throughput": 100.0, "plans": {"1": {"cycles": 60, "mean_ms": all_ms}},
                "plans_by_batch": {"4": {"1": {"cycles": 50, "mean_ms": at4_ms}}}}

    (e,) = paired_ratios([row("ar", 50.0, 60.0), row("async", 60.0, 60.0)], "ar")
    assert e["plain_step"]["ratio"] == pytest.approx(1.0)


def test_a_handful_of_plain_cycles_is_no_plain_step():
    def row(mode, cycles):
        return {"mode": mode, "round": 0, "dataset": "d", "concurrency": 4, "variant": "plain",
                "output_throughput": 100.0,
                "plans_by_batch": {"4": {"1": {"cycles": cycles, "mean_ms": 60.0}}}}

    (e,) = paired_ratios([row("ar", 250), row("async", 1)], "ar")
    assert e["plain_step"] is None and e["tok_s_equal_plain"] is None
