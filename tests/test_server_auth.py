"""API keys with the real `openai` client: the right key, a wrong one, none."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.args import ServerConfig, parse_args
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), api_keys=KEYS)
    with ServerThread(create_app(cfg)) as s:
        yield s


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_is_let_in(srv, key):
    c = client(srv, key)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="w5 w6", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=3, stream=True
    )
    assert any(ch.choices and ch.choices[0].finish_reason for ch in stream)


def test_a_wrong_key_gets_401_in_openai_shape(srv):
    c = client(srv, "key-one-but-longer")
    with pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}])
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key"
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_no_key_gets_401(srv):
    # The openai client always sends its key; an empty one leaves only "Bearer".
    with pytest.raises(openai.AuthenticationError) as e:
        client(srv, "").completions.create(model="tiny", prompt="w5", max_tokens=2)
    assert "no API key" in e.value.body["message"]
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "w5"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_health_and_metrics_stay_open_and_count_the_refusals(srv):
    assert httpx.get(f"{srv.url}/health").status_code == 200
    text = httpx.get(f"{srv.url}/metrics").text
    line = next(ln for ln in text.splitlines() if 'reason="unauthorized"' in ln)
    assert float(line.split()[-1]) >= 3


def test_metrics_can_be_closed_too(tiny_pair_dir):
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), api_keys=KEYS,
                              metrics_need_key=True)  # fmt: skip
    with ServerThread(create_app(cfg)) as s:
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        ok = httpx.get(f"{s.url}/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert ok.status_code == 200 and "d3d:request_rejected_total" in ok.text
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_keys_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("D3D_API_KEY", "env-a,env-b")
    cfg = parse_args(["--api-key", "flag-a", "--api-key", "env-a"])
    assert cfg.api_keys == ("flag-a", "env-a", "env-b")
    monkeypatch.delenv("D3D_API_KEY")
    assert parse_args([]).api_keys == ()
    assert ServerConfig().host == "127.0.0.1"  # reachable from this machine only by default
    with pytest.raises(SystemExit):
        parse_args(["--metrics-need-key"])  # closing /metrics needs a key to open it with
