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
