"""Big request bodies: a size limit (413), and no stall of the event loop while big bodies are
parsed, templated and tokenized (/health once took 17.5 s during a 10 MB request)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

MB = 1024 * 1024


def ten_mb_prompt() -> bytes:
    """10 MB of prompt text in 250k long words: a second or two of tokenizer work."""
    words = " ".join(f"w{i % 97 + 3}" + "x" * 36 for i in range(270_000))
    return json.dumps({"prompt": words[: 10 * MB - 20], "max_tokens": 4}).encode()


def many_messages(n: int = 100_000) -> bytes:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"w{i % 90 + 3}"}
            for i in range(n)]  # fmt: skip
    return json.dumps({"messages": msgs, "max_tokens": 4}).encode()


def post(url: str, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=body, headers=headers, timeout=120)


def test_bodies_over_the_limit_get_413(tiny_pair_dir):
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), max_body_bytes=1000)
    with ServerThread(create_app(cfg)) as srv:
        body = json.dumps({"prompt": "w5 " * 400}).encode()
        r = post(srv.url, "/v1/completions", body)
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "body_too_large" and "1000 bytes" in err["message"]

        def chunked():  # no Content-Length: the limit is enforced while reading
            for i in range(0, len(body), 100):
                yield body[i : i + 100]

        headers = {"content-type": "application/json"}
        r = httpx.post(f"{srv.url}/v1/chat/completions", content=chunked(), headers=headers)
        assert r.request.headers["transfer-encoding"] == "chunked"
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        small = json.dumps({"prompt": "w5", "max_tokens": 2}).encode()
        assert post(srv.url, "/v1/completions", small).status_code == 200


# The big requests come from another process, as real clients do: in this one their uploads
# would compete with the server for the GIL and blur what is measured.
SENDER = """
import json, sys, threading
import httpx
sys.path.insert(0, sys.argv[2])
from test_server_load import many_messages, post, ten_mb_prompt
url, out = sys.argv[1], {}
jobs = {"big": ("/v1/completions", ten_mb_prompt()), "many": ("/v1/chat/completions", many_messages())}
print("ready", flush=True)
def send(name):
    r = post(url, *jobs[name])
    out[name] = [r.status_code, r.json()["error"]["code"]]
ts = [threading.Thread(target=send, args=(n,)) for n in jobs]
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps(out), flush=True)
"""


def test_health_answers_quickly_while_huge_requests_are_in_flight(tiny_pair_dir):
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), max_body_bytes=16 * MB)
    assert len(ten_mb_prompt()) > 10 * MB - 100 and len(many_messages()) > 3 * MB
    here = str(Path(__file__).parent)
    with ServerThread(create_app(cfg)) as srv:
        sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, srv.url, here], stdout=subprocess.PIPE, text=True
        )
        assert sender.stdout.readline().strip() == "ready"
        latencies = []
        with httpx.Client(base_url=srv.url, timeout=10) as probe:
            while sender.poll() is None:
                t0 = time.perf_counter()
                assert probe.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
        results = json.loads(sender.stdout.read())
    # Both prompts are far beyond the 256-token context: refused once tokenized.
    assert results == {"big": [400, "context_length_exceeded"],
                       "many": [400, "context_length_exceeded"]}  # fmt: skip
    assert len(latencies) >= 10, "the requests finished too fast to probe"
    # The 100 ms budget holds for nine probes in ten. On a small machine shared with other
    # jobs (this project's has 2 cores) the OS deschedules any thread now and then, so a single
    # probe may take longer; the bound on all of them still catches a blocked event loop,
    # which took 3.8 s and 17.5 s before the work moved off the event loop.
    p90 = statistics.quantiles(latencies, n=10)[-1]
    assert p90 < 0.1 and max(latencies) < 0.5, sorted(latencies)[-5:]
