"""A server with the adaptive controller times its plans before it reports healthy, and then
serves exactly what plain decoding serves."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.config import Mode

pytestmark = pytest.mark.slow


def _complete(url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_calibrated_server_is_ready_only_once_timed_and_serves_exactly(tiny_pair_dir):
    prompts = ["w5 w6 w7", "w40 w41", "w9 w9 w9 w9"]
    plain = tiny_server_config(tiny_pair_dir, mode=Mode.AR, max_batch_size=4)
    with ServerThread(create_app(plain)) as srv:
        want = [_complete(srv.url, p) for p in prompts]
    cfg = tiny_server_config(tiny_pair_dir, max_batch_size=4, adaptive=True, calibrate=True)
    with ServerThread(create_app(cfg)) as srv:  # returns once /health says ready
        ctl = srv.app.state.d3d.holder.get().engine.controller
        timed = {b for b, _ in ctl.samples}
        assert timed == {1, 2, 4} and ctl.reached == []  # every bucket, no acceptance yet
        assert [_complete(srv.url, p) for p in prompts] == want
        text = httpx.get(f"{srv.url}/metrics").text
        _check_controller_metrics(text, ctl)
        held = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
                if f.name.startswith("d3d:shared_lookup")}
        # what the three answered requests left there
        assert held["d3d:shared_lookup_tokens"] == len(srv.app.state.d3d.holder.get().engine.shared_text) > 0
        assert held["d3d:shared_lookup_lookups"] >= held["d3d:shared_lookup_found"] >= 0


def _check_controller_metrics(text: str, ctl) -> None:
    """/metrics shows the controller's estimates (every timed plan at every bucket) and the
    plans it ran, cycle by cycle."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    est = {(s.labels["batch"], s.labels["block"], s.labels["predraft"]): s.value
           for s in fams["d3d:controller_tokens_per_second"].samples}
    assert len(est) == len(ctl.times) and all(v > 0 for v in est.values())
    assert {b for b, _, _ in est} == {"1", "2", "4"}
    assert len(fams["d3d:controller_accept_rate"].samples) == len(ctl.accept_rates())
    ran = {s.labels["block"]: s.value for s in fams["d3d:spec_plan_cycles"].samples
           if s.name.endswith("_total")}
    # the controller's plans, and cycles of copies, which are no plan's (block "copy")
    assert sum(ran.values()) > 0 and set(ran) <= {str(p.block) for p in ctl.candidates} | {"copy"}
