"""A server with the adaptive controller is ready once its models load, times its plans while
no request is in (pausing for any that arrives), keeps what it measured for the next start, and
serves exactly what plain decoding serves."""

from __future__ import annotations

import time

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


def _calibrated(srv, timeout: float = 60.0):
    """The server's engine loop once its calibration is done."""
    loop = srv.app.state.d3d.holder.get()
    deadline = time.monotonic() + timeout
    while loop.calibrating and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loop.calibrating
    return loop


def test_a_calibrated_server_times_every_plan_while_idle_and_serves_exactly(
        tiny_pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_CALIBRATION_CACHE", str(tmp_path))  # nothing measured before
    prompts = ["w5 w6 w7", "w40 w41", "w9 w9 w9 w9"]
    plain = tiny_server_config(tiny_pair_dir, mode=Mode.AR, max_batch_size=4)
    with ServerThread(create_app(plain)) as srv:
        want = [_complete(srv.url, p) for p in prompts]
    cfg = tiny_server_config(tiny_pair_dir, max_batch_size=4, adaptive=True, calibrate=True)
    with ServerThread(create_app(cfg)) as srv:  # returns once /health says ready
        ctl = _calibrated(srv).engine.controller
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


def test_a_server_serves_while_it_calibrates(tiny_pair_dir, tmp_path, monkeypatch):
    """A calibration that would run for ever: /health is ready, a request is answered (the
    calibration hands the engine back between two steps), and calibrating goes on after."""
    monkeypatch.setenv("D3D_CALIBRATION_CACHE", str(tmp_path))
    import sglang_d3d.engine.calibrate as calibrate

    paused = []

    def endless(engine, script, batch, plans, cfg, stop):
        while not stop():
            time.sleep(0.01)
        paused.append(batch)
        return False

    monkeypatch.setattr(calibrate, "_measure_bucket", endless)
    plain = tiny_server_config(tiny_pair_dir, mode=Mode.AR, max_batch_size=4)
    with ServerThread(create_app(plain)) as srv:
        want = _complete(srv.url, "w5 w6 w7")
    cfg = tiny_server_config(tiny_pair_dir, max_batch_size=4, adaptive=True, calibrate=True)
    with ServerThread(create_app(cfg)) as srv:
        loop = srv.app.state.d3d.holder.get()
        assert loop.calibrating and httpx.get(f"{srv.url}/health").status_code == 200
        assert loop.num_running == 0  # the calibration's requests are nobody's
        scraped = httpx.get(f"{srv.url}/metrics")  # the controller's metrics while calibrating
        assert scraped.status_code == 200 and "d3d:controller_accept_rate" in scraped.text
        assert "d3d:shared_lookup_tokens" in scraped.text  # the served index, not none
        assert _complete(srv.url, "w5 w6 w7") == want
        assert paused == [1] and loop.calibrating  # stopped for the request, due again


def test_d3d_serve_with_calibration_is_ready_within_60_s_and_the_next_start_reuses_it(
        tiny_pair_dir, tmp_path):
    """`d3d serve` as a user starts it, calibration on: ready in well under a minute, the
    calibration's progress in the log, and a second start on the same key measures nothing."""
    cache = tmp_path / "cache"
    first, ready_s = _serve_until_calibrated(tiny_pair_dir, cache, tmp_path / "first.log")
    assert ready_s < 60, first
    assert "calibrating the controller: batch 1 (1 of 3 sizes)" in first
    assert "calibrated the controller in" in first
    assert len(list(cache.glob("*.json"))) == 1
    second, _ = _serve_until_calibrated(tiny_pair_dir, cache, tmp_path / "second.log")
    assert "reusing the times measured at an earlier start for batch sizes [1, 2, 4]" in second
    assert "calibrating the controller" not in second


def _serve_until_calibrated(pair, cache, log_path) -> tuple[str, float]:
    """Start `d3d serve`, wait for /health, then for the calibration's last line; the log and
    the seconds to ready."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang_d3d", "serve", "--target", pair[0], "--drafter", pair[1],
           "--port", str(port), "--max-batch-size", "4", "--max-context", "256",
           "--block-size", "4", "--dtype", "float32", "--calibrate", "--threads", "1"]
    env = {**os.environ, "D3D_CALIBRATION_CACHE": str(cache)}
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            ready_s = _wait(lambda: _healthy(port), 120, proc) - t0
            _wait(lambda: "calibrated the controller" in log_path.read_text()
                  or "reusing the times" in log_path.read_text(), 60, proc)
        finally:
            proc.terminate()
            proc.wait(30)
    return log_path.read_text(), ready_s


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(ok, timeout: float, proc) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return time.monotonic()
        assert proc.poll() is None, "the server exited"
        time.sleep(0.2)
    raise AssertionError("timed out")
