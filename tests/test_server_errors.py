"""Bad input gets a clear 4xx in OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

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
    ("n over 128", "POST", CHAT, chat(n=129), 400, "n"),
    ("n over the queue", "POST", CHAT, chat(n=100), 400, "n"),
    ("temperature NaN", "POST", CHAT, b'{"messages": [{"role": "user", "content": "w5"}], '
     b'"temperature": NaN}', 400, "temperature"),
    ("top_p Infinity", "POST", COMPLETIONS, b'{"prompt": "w5", "top_p": Infinity}', 400, "top_p"),
    ("top_logprobs 21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs alone", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion logprobs 21", "POST", COMPLETIONS, {"prompt": "w5", "logprobs": 21}, 400,
     "logprobs"),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools"),
    ("tool_choice required", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("functions", "POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    # the tiny word vocabulary has no `{`: it cannot start a JSON object
    ("response_format json_schema, no schema", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format"),
    ("response_format json_object", "POST", CHAT, chat(response_format={"type": "json_object"}),
     400, "response_format"),
    ("response_format of an unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}),
     400, "response_format.type"),
    ("regex that does not compile", "POST", COMPLETIONS, {"prompt": "w5", "regex": "a("}, 400,
     "regex"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}),
     400, "stream_options"),
    ("frequency_penalty above 2", "POST", CHAT, chat(frequency_penalty=2.5), 400,
     "frequency_penalty"),
    ("presence_penalty below -2", "POST", COMPLETIONS, {"prompt": "w5", "presence_penalty": -3},
     400, "presence_penalty"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"w5": 10}), 400,
     "logit_bias"),
    ("logit_bias above 100", "POST", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias outside the vocabulary", "POST", CHAT, chat(logit_bias={"100000": 1}), 400,
     "logit_bias"),
    ("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_p above 1", "POST", COMPLETIONS, {"prompt": "w5", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens above max_tokens", "POST", COMPLETIONS,
     {"prompt": "w5", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("ignore_eos not a bool", "POST", CHAT, chat(ignore_eos="yes"), 400, "ignore_eos"),
    ("stop_token_ids outside the vocabulary", "POST", CHAT, chat(stop_token_ids=[100000]), 400,
     "stop_token_ids"),
    ("stop_token_ids negative", "POST", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("store", "POST", CHAT, chat(store=True), 400, "store"),
    ("audio", "POST", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("modalities audio", "POST", CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    ("prediction", "POST", CHAT, chat(prediction={"type": "content", "content": "x"}), 400,
     "prediction"),
    ("reasoning_effort", "POST", CHAT, chat(reasoning_effort="high"), 400, "reasoning_effort"),
    ("echo", "POST", COMPLETIONS, {"prompt": "w5", "echo": True}, 400, "echo"),
    ("suffix", "POST", COMPLETIONS, {"prompt": "w5", "suffix": "w9"}, 400, "suffix"),
    ("best_of below n", "POST", COMPLETIONS, {"prompt": "w5", "n": 3, "best_of": 2}, 400,
     "best_of"),
    ("best_of streamed", "POST", COMPLETIONS, {"prompt": "w5", "best_of": 2, "stream": True}, 400,
     "best_of"),
    ("tool message without id", "POST", CHAT, chat(messages=[{"role": "tool", "content": "4"}]),
     400, "messages.0"),
    ("tool_calls on a user turn", "POST", CHAT, chat(messages=[{"role": "user", "content": "x",
     "tool_calls": []}]), 400, "messages.0"),
    ("no content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0"),
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
