"""Bad input gets a clear 4xx in OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest

from server.app import create_app
from server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "w5 w6"}]


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **kw}


# (name, method, path, body: dict | bytes | None, status, error param or None)
BAD_INPUTS = [
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, None),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("no messages", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("bad role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, None),
    (
        "content is a number",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        None,
    ),
    ("max_tokens is a string", "POST", CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens over context", "POST", CHAT, chat(max_tokens=10_000), 400, "max_tokens"),
    ("temperature too high", "POST", CHAT, chat(temperature=5), 400, "temperature"),
    ("temperature is a string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_k below -1", "POST", CHAT, chat(top_k=-2), 400, "top_k"),
    ("seed negative", "POST", CHAT, chat(seed=-1), 400, "seed"),
    ("stop is a number", "POST", CHAT, chat(stop=7), 400, "stop"),
    ("stream is 1", "POST", CHAT, chat(stream=1), 400, "stream"),
    ("bad stream_options", "POST", CHAT, chat(stream_options={"include_usage": "y"}), 400, None),
    ("n=2", "POST", CHAT, chat(n=2), 400, "n"),
    ("unknown model", "POST", CHAT, chat(model="gpt-5"), 404, "model"),
    ("prompt over context", "POST", COMPLETIONS, {"prompt": "w5 " * 300}, 400, "prompt"),
    ("empty prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("token id out of vocab", "POST", COMPLETIONS, {"prompt": [5, 10**6]}, 400, "prompt"),
    ("two prompts", "POST", COMPLETIONS, {"prompt": ["w5", "w6"]}, 400, "prompt"),
    ("no prompt", "POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("unknown route", "GET", "/v1/nothing", None, 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
]


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    cfg = tiny_server_config(tiny_pair_dir)
    with ServerThread(create_app(cfg)) as s:
        yield s


def _send(url: str, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.request(method, url + path, content=body, headers=headers, timeout=30)


def assert_error_shape(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


@pytest.mark.parametrize(
    "method, path, body, status, param", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_gets_a_clear_error(srv, method, path, body, status, param):
    r = _send(srv.url, method, path, body)
    assert r.status_code == status, r.text
    err = assert_error_shape(r)
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param + "."), err


def test_context_errors_say_so(srv):
    err = _send(srv.url, "POST", CHAT, chat(max_tokens=10_000)).json()["error"]
    assert err["code"] == "context_length_exceeded" and "256" in err["message"]


def test_server_is_healthy_after_the_bad_inputs(srv):
    for _, method, path, body, _, _ in BAD_INPUTS:
        _send(srv.url, method, path, body)
    assert httpx.get(srv.url + "/health").status_code == 200
    r = _send(srv.url, "POST", CHAT, chat(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    engine = srv.app.state.d3d.holder.get()
    assert engine.num_running == 0 and engine.num_waiting == 0
