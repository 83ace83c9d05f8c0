"""The order of interleaved benchmark runs (sglang_d3d/interleave.py)."""

from __future__ import annotations

from sglang_d3d.interleave import rotated


def test_each_round_starts_with_the_next_mode():
    modes = ["ar", "sync", "async"]
    rounds = [rotated(modes, k) for k in range(6)]
    assert rounds[0] == modes and rounds[1] == ["sync", "async", "ar"]
    assert rounds[3] == modes  # wraps around
    assert [r[0] for r in rounds] == modes * 2  # every mode first equally often
    assert all(sorted(r) == sorted(modes) for r in rounds)
    assert rotated([], 3) == [] and rotated(["ar"], 5) == ["ar"]
