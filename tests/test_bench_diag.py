"""benchmarks/diag_controller.py: one engine of a `d3d bench` run gets other controller settings."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

import sglang_d3d.bench as bench
from benchmarks.diag_controller import patch, setting


def test_settings_parse_as_name_and_number():
    assert setting("tree_prior=1e12") == ("tree_prior", 1e12)
    for bad in ("tree_prior", "=3", "tree_prior="):
        with pytest.raises(argparse.ArgumentTypeError):
            setting(bad)


def test_only_the_chosen_engine_is_changed(monkeypatch):
    made = []

    def fake(cfg):
        made.append(SimpleNamespace(controller=SimpleNamespace(tree_prior=16.0)))
        return made[-1]

    monkeypatch.setattr(bench, "SpecEngine", fake)
    patch(2, {"tree_prior": 1e12})
    engines = [bench.SpecEngine(None) for _ in range(3)]
    assert [e.controller.tree_prior for e in engines] == [16.0, 1e12, 16.0]


def test_an_unknown_setting_is_refused(monkeypatch):
    monkeypatch.setattr(bench, "SpecEngine", lambda cfg: SimpleNamespace(controller=SimpleNamespace()))
    patch(1, {"no_such_knob": 1.0})
    with pytest.raises(SystemExit, match="no_such_knob"):
        bench.SpecEngine(None)
