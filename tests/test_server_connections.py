"""Connections cannot be held (server/http_layer.py): headers must arrive within
--header-timeout, idle kept-alive connections close after --keep-alive-timeout, connections past
--max-connections get 503; a client that leaves mid-body is no error; 413 and 408 close their
connection; HEAD /health; the API's description behind the API key (server/auth.py)."""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import replace

import httpx
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.http_layer import ConnectionLimits
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

HEADER_TIMEOUT = 1.5  # seconds (the flag's default is 30)
KEEP_ALIVE = 2.0
MAX_CONNECTIONS = 6
DEADLINE = 30.0  # a connection still open after this long counts as held forever
SLACK = 5.0  # seconds a timer may fire late on a loaded machine
KEY = "secret-key"


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    limits = ConnectionLimits(HEADER_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS)
    cfg = replace(tiny_server_config(tiny_pair_dir), connections=limits, max_body_bytes=1000,
                  body_timeout=2.0, api_keys=(KEY,))
    with ServerThread(create_app(cfg)) as s:
        yield s


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=DEADLINE)


def _closed_after(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closed the connection, and what it sent before."""
    start, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - start, got


def _errors_500(srv) -> float:
    r = httpx.get(srv.url + "/metrics", timeout=DEADLINE)
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("d3d:request_errors_total") and 'status="500"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_slow_header_connection_is_closed_within_the_header_timeout(srv):
    sock = _connect(srv)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    try:
        for i in range(int(DEADLINE / 0.5)):  # a header line every half second, never the end
            time.sleep(0.5)
            sock.sendall(b"X-Slow-%d: y\r\n" % i)
    except (BrokenPipeError, ConnectionResetError):
        pass
    waited, got = _closed_after(sock)
    sock.close()
    assert time.monotonic() - t0 < HEADER_TIMEOUT + SLACK
    assert got.startswith(b"HTTP/1.1 408")
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "header_timeout"


def test_a_connection_that_sends_nothing_is_closed_within_the_header_timeout(srv):
    sock = _connect(srv)
    waited, got = _closed_after(sock)
    sock.close()
    assert waited < HEADER_TIMEOUT + SLACK and got == b""


def test_an_idle_kept_alive_connection_is_closed_and_a_busy_one_is_not(srv):
    with httpx.Client(base_url=srv.url, timeout=DEADLINE) as client:
        for _ in range(3):  # requests closer together than both timeouts: one connection
            assert client.get("/health").status_code == 200
            time.sleep(HEADER_TIMEOUT * 0.6)
    sock = _connect(srv)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    waited, got = _closed_after(sock)
    sock.close()
    assert got.startswith(b"HTTP/1.1 200") and KEEP_ALIVE - 0.5 < waited < KEEP_ALIVE + SLACK


def test_connections_past_the_cap_get_503_and_are_closed(srv):
    held = [_connect(srv) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # all accepted
        extra = _connect(srv)
        waited, got = _closed_after(extra)
        extra.close()
        assert got.startswith(b"HTTP/1.1 503") and waited < 5.0
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + DEADLINE
    while httpx.get(srv.url + "/health", timeout=DEADLINE).status_code != 200:
        assert time.monotonic() < deadline


def test_a_client_that_leaves_mid_body_is_no_error(srv, caplog, capfd):
    before = _errors_500(srv)
    with caplog.at_level(logging.WARNING):
        sock = _connect(srv)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{\"model\": \"tiny\", ")
        time.sleep(0.3)  # the server is reading the body
        sock.close()
        time.sleep(1.0)
        assert httpx.get(srv.url + "/health", timeout=DEADLINE).status_code == 200
    assert _errors_500(srv) == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("head, sent, status", [
    (b"Transfer-Encoding: chunked\r\n", b"5dc\r\n" + b"x" * 1500 + b"\r\n", 413),
    (b"Content-Length: 2000\r\n", b"", 413),
    (b"Content-Length: 100\r\n", b'{"model": ', 408),
])  # fmt: skip
def test_413_and_408_say_connection_close_and_close(srv, head, sent, status):
    sock = _connect(srv)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Type: application/json\r\n" + head + b"\r\n"
                 + sent)
    waited, got = _closed_after(sock)
    sock.close()
    head_text = got.split(b"\r\n\r\n", 1)[0].lower()
    assert got.startswith(b"HTTP/1.1 %d" % status) and b"connection: close" in head_text
    assert waited < 5.0


def test_head_health_is_answered(srv):
    r = httpx.head(srv.url + "/health", timeout=DEADLINE)
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_api_description_needs_the_key_where_v1_does(srv, path):
    r = httpx.get(srv.url + path, timeout=DEADLINE)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.get(srv.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=DEADLINE)
    assert ok.status_code == 200
    assert httpx.get(srv.url + "/health", timeout=DEADLINE).status_code == 200
