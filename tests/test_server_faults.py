"""Faults: loading, a full queue, clients that hang up, a request that fails, shutdown.

The real engine runs throughout. To make timing-dependent cases deterministic, a cycle
listener (called on the engine thread) slows each verify cycle down; it changes no output.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.api import TokenEvent
from sglang_d3d.engine.factory import build_engine_loop

pytestmark = pytest.mark.slow

POISON = [90, 91, 92, 93]  # prompts starting with these ids fail inside the engine


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return tiny_pair_dir


def slowed(delay: float, wrap=lambda loop: loop):
    """Engine factory: the real engine loop, each request's verify cycle `delay` s slower."""

    def factory(cfg):
        loop = build_engine_loop(cfg)
        loop.add_cycle_listener(lambda rid, c: time.sleep(delay))
        return wrap(loop)

    return factory


def completion(url: str, timeout: float = 60, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def finished_count(url: str, reason: str) -> float:
    return metric(url, "d3d:request_success_total", finish_reason=reason)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
    return total


def engine_of(srv: ServerThread):
    return srv.app.state.d3d.holder.get()


def idle(srv: ServerThread) -> bool:
    e = engine_of(srv)
    return e.num_running == 0 and e.num_waiting == 0


# ---- loading ----------------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(pair):
    release = threading.Event()

    def factory(cfg):
        release.wait(30)
        return build_engine_loop(cfg)

    srv = ServerThread(create_app(tiny_server_config(pair), factory)).start(wait_ready=False)
    try:
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = completion(srv.url)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "loading"
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200
        release.set()
        assert wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200, 60)
        assert completion(srv.url).status_code == 200
    finally:
        release.set()
        srv.stop()


def test_a_failed_load_is_reported_not_hidden(pair):
    def factory(cfg):
        raise FileNotFoundError("no drafter at /nowhere")

    with ServerThread(create_app(tiny_server_config(pair), factory)).start(wait_ready=False) as srv:
        r = httpx.get(f"{srv.url}/health")
        assert wait_until(
            lambda: httpx.get(f"{srv.url}/health").json()["error"]["code"] == "failed"
        )
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and "no drafter at /nowhere" in r.json()["error"]["message"]
        assert completion(srv.url).status_code == 503


# ---- a full queue -----------------------------------------------------------------------------


def test_full_queue_gets_503_with_retry_after(pair):
    cfg = tiny_server_config(pair, max_batch_size=1, max_queue=1)
    with ServerThread(create_app(cfg, slowed(0.02))) as srv:
        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda _: completion(srv.url, max_tokens=24), range(6)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        for r in rs:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        assert wait_until(lambda: idle(srv))
        assert completion(srv.url).status_code == 200  # serving again once the queue drained
        refused = codes.count(503)
        assert metric(srv.url, "d3d:request_rejected_total", reason="queue_full") == refused
        assert metric(srv.url, "d3d:request_errors_total", status="503") == refused


# ---- clients that hang up ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_srv(pair):
    with ServerThread(create_app(tiny_server_config(pair, max_batch_size=2), slowed(0.04))) as s:
        yield s


def test_disconnect_mid_stream_aborts_the_request(slow_srv):
    url, before = slow_srv.url, finished_count(slow_srv.url, "abort")
    body = {"prompt": "w5 w6", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_of(slow_srv).num_running == 1
    # 240 tokens take >= 60 cycles = 2.4 s at this speed; an abort frees the slot before that.
    assert wait_until(lambda: idle(slow_srv), 2.0)
    assert finished_count(url, "abort") == before + 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_every_choice_of_an_n_request(slow_srv, stream):
    url, before = slow_srv.url, finished_count(slow_srv.url, "abort")
    body = {"prompt": "w5 w6", "max_tokens": 240, "temperature": 1.0, "n": 2, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            assert next(r.iter_lines()).startswith("data: ")
            assert engine_of(slow_srv).num_running == 2  # both choices, one slot each
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    assert wait_until(lambda: idle(slow_srv), 2.0)
    assert finished_count(url, "abort") == before + 2


def test_disconnect_while_waiting_in_the_queue_aborts_too(slow_srv):
    url, engine = slow_srv.url, engine_of(slow_srv)
    before = finished_count(url, "abort")
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(completion, url, max_tokens=80) for _ in range(2)]  # both slots
        assert wait_until(lambda: engine.num_running == 2)
        with pytest.raises(httpx.ReadTimeout):
            completion(url, timeout=0.3, max_tokens=40)  # queued, then the client gives up
        # It leaves the queue while the two long requests still hold both slots.
        assert wait_until(lambda: engine.num_waiting == 0, 0.5)
        assert engine.num_running == 2
        assert all(f.result().status_code == 200 for f in busy)
    assert wait_until(lambda: idle(slow_srv))
    assert finished_count(url, "abort") == before + 1


def test_non_streaming_client_that_gives_up_frees_its_slot(slow_srv):
    before = finished_count(slow_srv.url, "abort")
    with pytest.raises(httpx.ReadTimeout):
        completion(slow_srv.url, timeout=0.5, max_tokens=240)
    assert wait_until(lambda: idle(slow_srv), 1.5)
    assert finished_count(slow_srv.url, "abort") == before + 1


# ---- one failing request ----------------------------------------------------------------------


class FailingEngine:
    """The real engine loop, except that POISON requests fail after their first tokens, the
    way the engine reports a per-request fault (final event with finish_reason "error")."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def submit(self, req, on_event) -> None:
        if req.prompt_ids[: len(POISON)] != POISON:
            return self._inner.submit(req, on_event)
        failed = threading.Event()

        def relay(ev: TokenEvent) -> None:
            if failed.is_set():
                return
            on_event(TokenEvent(req.request_id, ev.token_ids))
            failed.set()
            self._inner.abort(req.request_id)
            on_event(TokenEvent(req.request_id, [], True, "error", "injected fault", None))

        self._inner.submit(req, relay)


def test_a_failing_request_fails_alone(pair):
    cfg = tiny_server_config(pair)
    with ServerThread(create_app(cfg, slowed(0.005, FailingEngine))) as srv:
        solo = completion(srv.url, max_tokens=20).json()["choices"][0]["text"]
        with ThreadPoolExecutor(5) as pool:
            good = [pool.submit(completion, srv.url, max_tokens=20) for _ in range(4)]
            bad = pool.submit(completion, srv.url, prompt=POISON + [5, 6], max_tokens=20)
            r = bad.result()
            assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
            assert all(f.result().json()["choices"][0]["text"] == solo for f in good)
        body = {"prompt": POISON, "max_tokens": 20, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert '"error"' in lines[-2] and "injected fault" in lines[-2]
        assert lines[-1] == "data: [DONE]"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert wait_until(lambda: idle(srv))
        # one failure answered with a 500, one reported inside its stream; neither is a refusal
        assert metric(srv.url, "d3d:request_errors_total", type="internal_server_error") == 2
        assert metric(srv.url, "d3d:request_rejected_total") == 0


# ---- shutdown ---------------------------------------------------------------------------------


def test_shutdown_lets_in_flight_streams_finish(pair):
    srv = ServerThread(create_app(tiny_server_config(pair), slowed(0.02)), drain_timeout=10)
    srv.start()
    engine = engine_of(srv)
    body = {"prompt": "w5 w6", "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        rest = [line for line in lines if line]
    stopper.join(30)
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]
    assert not srv.app.state.d3d.holder.ready  # the engine was shut down
    assert engine.num_running == 0 and engine.num_waiting == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health")
