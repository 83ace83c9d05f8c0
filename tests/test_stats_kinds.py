"""Cycles tallied by kind (plain / copy / draft) and the per-kind summary `d3d bench` prints."""

from __future__ import annotations

import pytest

from sglang_d3d.speculative.stats import CycleStats, RequestStats, kind_summary


def _cycle(drafts: int, accepted: int, seconds: float, copied: bool = False) -> CycleStats:
    return CycleStats(drafts, accepted, None, 0.0, seconds, seconds, 0.0, copied=copied)


def test_a_cycle_kind_follows_what_it_verified():
    assert _cycle(0, 0, 0.01).kind == "plain"
    assert _cycle(4, 2, 0.02, copied=True).kind == "copy"
    assert _cycle(7, 3, 0.05).kind == "draft"


def test_request_stats_tally_each_kind():
    st = RequestStats()
    for c in (_cycle(0, 0, 0.010), _cycle(4, 3, 0.020, copied=True), _cycle(4, 0, 0.030, copied=True),
              _cycle(7, 2, 0.050)):
        st.add_cycle(c)
    assert st.kind_cycles == {"plain": 1, "copy": 2, "draft": 1}
    assert st.kind_tokens == {"plain": 1, "copy": 5, "draft": 3}  # accepted drafts + 1 each
    assert st.kind_seconds == pytest.approx({"plain": 0.010, "copy": 0.050, "draft": 0.050})
    assert sum(st.kind_tokens.values()) == sum(st.accepted_lengths)
    assert st.to_dict()["kind_cycles"] == st.kind_cycles  # reaches the JSON surfaces


def test_kind_summary():
    out = kind_summary({"plain": 2, "draft": 2}, {"plain": 2, "draft": 6}, {"plain": 0.08, "draft": 0.12})
    assert list(out) == ["plain", "draft"]  # in KINDS order; copy never ran, so it is left out
    assert out["plain"] == pytest.approx({"cycle_share": 0.5, "time_share": 0.4, "tokens_per_cycle": 1.0,
                                          "ms_per_cycle": 40.0, "tokens_per_s": 25.0})
    assert out["draft"] == pytest.approx({"cycle_share": 0.5, "time_share": 0.6, "tokens_per_cycle": 3.0,
                                          "ms_per_cycle": 60.0, "tokens_per_s": 50.0})
    assert kind_summary({}, {}, {}) == {}
