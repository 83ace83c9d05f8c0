"""A server with the adaptive controller times its plans before it reports healthy, and then
serves exactly what plain decoding serves."""

from __future__ import annotations

import httpx
import pytest
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
