"""Hostile or careless inputs get a 4xx in OpenAI's shape, and none can hold the server: grammar
compiles under a time limit, a cap and the client's presence (speculative/grammar_pool.py);
nesting, grammar sizes and per-request work bounded (server/limits.py); character classes that
match nothing refused (speculative/char_classes.py); slow uploads and huge headers ended
(server/body.py, server/http_layer.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace

import httpx
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.body import parse_body
from sglang_d3d.server.errors import APIError
from sglang_d3d.server.limits import (
    GrammarLimits,
    bracket_depth,
    check_source,
    json_depth_over,
    schema_counts,
)
from sglang_d3d.server.protocol import ChatCompletionRequest
from sglang_d3d.server.serving import check_work
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.config import GrammarSpec
from sglang_d3d.speculative.char_classes import class_ranges, empty_class, matches_nothing

MESSAGES = [{"role": "user", "content": "w30 w40 w31"}]
# Compiles for seconds on the tiny vocabulary (long enum strings cost xgrammar most), far
# longer than the limits and client timeouts below.
SLOW_SCHEMA = {"enum": ["x" * 1000 + str(i) for i in range(120)]}
BIG_SOURCES = GrammarLimits(max_bytes=256 * 1024)  # lets SLOW_SCHEMA through to the compiler
DEADLINE = 60.0  # seconds before a wait counts as hung
# A json_schema 1,000 levels deep (json.dumps itself cannot write one).
DEEP_SCHEMA_BODY = (b'{"model": "tiny", "messages": [{"role": "user", "content": "w3"}], '
                    b'"response_format": {"type": "json_schema", "json_schema": {"name": "d", '
                    b'"schema": ' + b'{"type": "array", "items": ' * 1000 + b'{"type": "string"}'
                    + b"}" * 1000 + b"}}}")


# ---- pure checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [r"^\s\S", r"^\d\D", r"^\w\W", r"^\S\s", r"^\0-\U0010ffff",
                                  r"^\x00-\uffff\U00010000-\U0010FFFF"])
def test_negated_classes_covering_every_character_match_nothing(body):
    assert matches_nothing(body)


@pytest.mark.parametrize("body", [r"\s\S", r"^a", r"a-z", r"^\s", r"^\d\s", r"^\0-\uffff", "-"])
def test_ordinary_classes_match_something(body):
    assert not matches_nothing(body)


def test_class_ranges_read_escapes_ranges_and_categories():
    assert class_ranges(r"a-c\x41\n") == (False, [(0x0A, 0x0A), (0x41, 0x41), (0x61, 0x63)])
    assert class_ranges(r"^\d_") == (True, [(0x30, 0x39), (0x5F, 0x5F)])


def test_empty_classes_are_found_in_each_kind_of_source():
    assert empty_class("regex", r"a[^\s\S]b|c") == r"[^\s\S]"
    assert empty_class("regex", r"\[^\s\S]") is None  # an escaped bracket opens no class
    assert empty_class("ebnf", r'root ::= "[^\s\S]" [^\d\D]') == r"[^\d\D]"
    assert empty_class("ebnf", r'root ::= "[^\s\S]" [a-z]') is None  # inside a string
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "[^\\w\\W]"}}}
    assert empty_class("json_schema", json.dumps(schema)) == r"[^\w\W]"
    assert empty_class("json_schema", json.dumps({"type": "string", "pattern": "[a-z]+"})) is None


def test_json_depth_is_walked_without_recursion():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth_over(deep, 64)
    assert not json_depth_over({"a": [[{"b": 1}]]}, 4) and json_depth_over({"a": [[{"b": {}}]]}, 4)
    assert not json_depth_over("text", 1)


def test_grammar_sources_over_the_limits_are_refused_before_compiling():
    small = GrammarLimits(max_bytes=1000, max_depth=8, max_enum=10, max_properties=5)
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6)}}
    cases = {
        GrammarSpec("regex", "a" * 1001): "--max-grammar-bytes",
        GrammarSpec("regex", "(" * 9 + "a" + ")" * 9): "--max-json-depth",
        GrammarSpec("ebnf", 'root ::= ' + "(" * 9 + '"a"' + ")" * 9): "--max-json-depth",
        GrammarSpec("json_schema", json.dumps({"enum": list(range(11))})): "--max-schema-enum",
        GrammarSpec("json_schema", json.dumps(many)): "--max-schema-properties",
        GrammarSpec("json_schema", "[" * 9 + "]" * 9): "--max-json-depth",
        GrammarSpec("regex", r"[^\s\S]"): "matches no character",
    }
    for spec, says in cases.items():
        assert says in check_source(spec, small).message, spec
    assert check_source(GrammarSpec("regex", "(a|b)+"), small) is None
    assert bracket_depth(r"\(\(([a])") == 2
    assert bracket_depth('root ::= "((((" ("a")', ebnf=True) == 1
    assert schema_counts({"anyOf": [{"enum": [1, 2]}, {"const": 3}, {"properties": {"a": {}}}]}) == (3, 1)


def test_a_workers_compiled_grammar_is_adopted_by_the_engines_compiler():
    import io

    from sglang_d3d.speculative.grammar import Grammars
    from sglang_d3d.speculative.grammar_worker import compile_job, frame, read
    from sglang_d3d.testing import tiny_pieces

    grammars = Grammars.for_pieces(tiny_pieces(), [2])
    spec = GrammarSpec("regex", "(a|b)(0|1)")
    status, compiled = compile_job(grammars._compiler, grammars.info, spec.kind, spec.source)
    assert status == "ok" and not grammars.has(spec)
    grammars.adopt(spec, compiled)
    assert grammars.has(spec) and grammars.constraint(spec).chain([]).shape[0] == 1
    assert compile_job(grammars._compiler, grammars.info, "regex", "zzz")[0] == "error"  # no token
    inp = io.BytesIO(frame("regex", "a\ud800"))
    assert (read(inp), read(inp), read(inp)) == ("regex", "a\ud800", None)


def test_a_pool_worker_that_died_while_idle_is_replaced():
    import asyncio
    import os
    import signal

    from sglang_d3d.speculative.grammar import Grammars
    from sglang_d3d.speculative.grammar_pool import GrammarPool
    from sglang_d3d.testing import tiny_pieces

    async def run() -> None:
        pool = GrammarPool(Grammars.for_pieces(tiny_pieces(), [2]).info.serialize_json(), 1, 60.0)
        try:
            assert await pool.compile(GrammarSpec("regex", "a|b"))
            (worker,) = pool._idle
            os.kill(worker.pid, signal.SIGKILL)
            await worker.wait()
            assert await pool.compile(GrammarSpec("regex", "a+"))  # on a new worker
            assert pool.num_workers == 1 and pool._idle[0] is not worker
        finally:
            pool.close()

    asyncio.run(run())


def test_work_per_request_is_bounded():
    check_work(4, 250, 1000)
    with pytest.raises(APIError, match="--max-request-tokens") as e:
        check_work(100, 2000, 65_536)
    assert e.value.status == 400 and e.value.param == "max_tokens"


def test_deeply_nested_bodies_are_400s_not_recursion_errors():
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body in (raw, b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(APIError, match="--max-json-depth") as e:
            parse_body(body, ChatCompletionRequest)
        assert e.value.status == 400 and e.value.code == "json_too_deep"
    with pytest.raises(APIError, match="nests deeper"):
        parse_body(DEEP_SCHEMA_BODY, ChatCompletionRequest)


# ---- through the server --------------------------------------------------------------------------
def _config(pair, **server):
    cfg = tiny_server_config(pair)
    return replace(cfg, **{"limits": BIG_SOURCES, "body_timeout": 1.0, **server})


@pytest.fixture(scope="module")
def srv(json_pair):
    """A server whose compiles stop after 1 s."""
    cfg = _config(json_pair, grammar_timeout=1.0, max_request_tokens=1000)
    with ServerThread(create_app(cfg)) as s:
        yield s


@pytest.fixture(scope="module")
def patient(json_pair):
    """A server with one compile worker and no practical time limit."""
    with ServerThread(create_app(_config(json_pair, grammar_timeout=600.0, grammar_workers=1))) as s:
        yield s


def _post(url: str, body: dict, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                                        **body}, timeout=kw.pop("timeout", DEADLINE), **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _schema(schema: dict) -> dict:
    return {"messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def _raw_request(port: int, body: bytes) -> socket.socket:
    """A chat request over a plain socket (the test decides when the client leaves)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_grammar_that_matches_nothing_is_a_400_naming_the_field(srv):
    for regex in (r"[^\s\S]", r"[^\d\D]", r"[^\w\W]"):
        err = _error(_post(srv.url, {"prompt": [21, 22], "regex": regex}, "/v1/completions"), 400)
        assert err["param"] == "regex" and "matches no character" in err["message"]
        assert err["code"] == "grammar_matches_nothing"
    err = _error(_post(srv.url, {"messages": MESSAGES, "ebnf": r"root ::= [^\s\S]"}), 400)
    assert err["param"] == "ebnf"


def test_a_compile_slower_than_the_limit_is_a_400_and_its_worker_is_stopped(srv):
    ok = _post(srv.url, {"prompt": [21, 22], "regex": "(a|b)(0|1)"}, "/v1/completions")
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a0", "a1", "b0", "b1")
    pools = srv.app.state.d3d.pools
    assert pools.num_workers == 1  # started for the first compile, and kept
    err = _error(_post(srv.url, _schema(SLOW_SCHEMA)), 400)
    assert err["param"] == "response_format" and err["code"] == "grammar_too_slow"
    assert "1 s (--grammar-timeout)" in err["message"]
    assert pools.num_workers == 0 and pools.in_flight == 0


def test_deep_bodies_and_deep_schemas_are_400s(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"content-type": "application/json"}, timeout=DEADLINE)
    assert _error(r, 400)["code"] == "json_too_deep"
    r = httpx.post(srv.url + "/v1/chat/completions", content=DEEP_SCHEMA_BODY,
                   headers={"content-type": "application/json"}, timeout=DEADLINE)
    assert _error(r, 400)["code"] == "json_too_deep"


def test_work_over_the_budget_is_a_400(srv):
    err = _error(_post(srv.url, {"prompt": [21, 22], "best_of": 4, "max_tokens": 251},
                       "/v1/completions"), 400)
    assert err["param"] == "max_tokens" and "4 x 251 = 1004" in err["message"]
    assert _post(srv.url, {"prompt": [21, 22], "best_of": 4, "max_tokens": 250,
                           "ignore_eos": True}, "/v1/completions").status_code == 200


@pytest.mark.parametrize("head, sent", [
    (b"Content-Length: 100\r\n", b'{"model": '),  # fewer bytes than declared
    (b"Transfer-Encoding: chunked\r\n", b"a\r\n{\"model\": \r\n"),  # no closing chunk
])
def test_an_unfinished_upload_gets_408_and_its_connection_closed(srv, head, sent):
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=DEADLINE)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n" + head + b"\r\n" + sent)
    reply = _read_all(sock)  # returns once the server closes the connection
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


@pytest.mark.parametrize("size", [70_000, 1_000_000])
def test_huge_headers_get_a_431_in_openais_shape(srv, size):
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer " + "k" * size},
                  timeout=DEADLINE)
    assert _error(r, 431)["code"] == "headers_too_large"
    assert httpx.get(srv.url + "/health", timeout=DEADLINE).status_code == 200


def test_a_client_that_leaves_stops_its_compile_and_others_are_served_meanwhile(patient):
    pools = patient.app.state.d3d.pools
    sock = _raw_request(patient.port, json.dumps({"model": "tiny", **_schema(SLOW_SCHEMA)}).encode())
    _wait(lambda: pools.in_flight == 1 and pools.num_workers == 1, "the compile to start")
    # Meanwhile: plain requests are served, and a second compile is refused (one worker).
    assert _post(patient.url, {"messages": MESSAGES}).status_code == 200
    busy = _post(patient.url, _schema({"enum": ["other"]}))
    assert _error(busy, 503)["code"] == "grammar_busy" and busy.headers["retry-after"] == "1"
    assert pools.in_flight == 1  # the slow compile was running all along
    sock.close()
    _wait(lambda: pools.in_flight == 0 and pools.num_workers == 0, "the worker to be stopped")


def test_shutdown_stops_compiles_in_flight(json_pair):
    server = ServerThread(create_app(_config(json_pair, grammar_timeout=600.0))).start()
    pools = server.app.state.d3d.pools
    sock = _raw_request(server.port, json.dumps({"model": "tiny", **_schema(SLOW_SCHEMA)}).encode())
    _wait(lambda: pools.in_flight == 1 and pools.num_workers == 1, "the compile to start")
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    reply = _read_all(sock)
    sock.close()
    stopper.join(DEADLINE)
    assert not stopper.is_alive()
    assert reply.startswith(b"HTTP/1.1 503") and pools.num_workers == 0
