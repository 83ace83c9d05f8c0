"""The server's request features end to end, through the real `openai` client: log-probabilities (equal in ar and
async mode, and to a plain forward pass), `n` and `best_of`, tool history, and text the
tokenizer cannot take (400, keep-alive connection kept)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.config import Mode

pytestmark = pytest.mark.slow

PROMPT_IDS = [5, 17, 23, 42, 8]


@pytest.fixture(scope="module")
def servers(tiny_pair_dir):
    ar = ServerThread(create_app(tiny_server_config(tiny_pair_dir, Mode.AR))).start()
    spec = ServerThread(create_app(tiny_server_config(tiny_pair_dir, Mode.ASYNC))).start()
    yield {"ar": ar, "async": spec}
    ar.stop()
    spec.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=f"{servers['async'].url}/v1", api_key="x", max_retries=0)


def tok_of(srv):
    return srv.app.state.d3d.holder.get().tokenizer


# ---- log-probabilities ------------------------------------------------------------------------


@torch.no_grad()
def plain_forward_logprobs(target_dir: str, prompt: list[int], out: list[int]) -> list[float]:
    from sglang_d3d.models.loading import load_hf_model

    hf = load_hf_model(Path(target_dir)).double()
    logp = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0].double(), -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(out)]


def test_logprobs_equal_in_ar_and_async_and_match_a_plain_forward(servers, tiny_pair_dir):
    got = {}
    for mode, srv in servers.items():
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        r = c.completions.create(
            model="tiny", prompt=PROMPT_IDS, max_tokens=16, temperature=0, logprobs=5
        )
        got[mode] = r.choices[0].logprobs
    ar, spec = got["ar"], got["async"]
    assert ar.tokens == spec.tokens and len(ar.tokens) == 16
    for a, s in zip(ar.token_logprobs, spec.token_logprobs, strict=True):
        assert s == pytest.approx(a, abs=1e-9)
    for a, s in zip(ar.top_logprobs, spec.top_logprobs, strict=True):
        assert list(a) == list(s) and len(a) == 5  # greedy: the chosen token is among the top 5
    ids = tok_of(servers["ar"]).convert_tokens_to_ids(ar.tokens)
    ref = plain_forward_logprobs(tiny_pair_dir[0], PROMPT_IDS, ids)
    assert ar.token_logprobs == pytest.approx(ref, abs=1e-9)


def _rounded(entry: dict) -> dict:
    """A logprobs entry with its log-probabilities to 9 decimals, alternatives included."""
    tops = [{**t, "logprob": round(t["logprob"], 9)} for t in entry.get("top_logprobs") or []]
    return {**entry, "logprob": round(entry["logprob"], 9), "top_logprobs": tops}


def test_chat_logprobs_shape_and_stream_equal_whole(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w9 w10 w11"}], max_tokens=12,
              temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.logprob and t.top_logprobs[0].token == t.token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    # the same tokens and log-probabilities; the second request may verify a copy of the
    # first's answer (shared_lookup.py), a pass of another width, so equal to rounding
    assert [_rounded(t.model_dump()) for t in streamed] == [_rounded(t.model_dump()) for t in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_stream_equal_whole_and_offsets_index_the_text(client):
    kw = dict(model="tiny", prompt="w30 w31 w32", max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    text = whole.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[offset:].lstrip().startswith(token)  # the word-level tokens drop the space
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


# ---- n and best_of ----------------------------------------------------------------------------


def _chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w40 w41"}], max_tokens=10, **kw
    )


def test_n_choices_each_equal_a_single_request_with_its_seed(client):
    """Choice i of a seeded request is the answer of the same request with seed + i: sampling
    stays exact per choice, even though they share one prefill."""
    r = _chat(client, n=3, temperature=1.5, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [_chat(client, temperature=1.5, seed=7 + i) for i in range(3)]
    for c, s in zip(r.choices, singles, strict=True):
        assert c.message.content == s.choices[0].message.content
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    chunks = list(_chat(client, n=3, temperature=1.5, seed=7, stream=True))
    texts = ["", "", ""]
    finish = [None] * 3
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in r.choices]
    assert finish == [c.finish_reason for c in r.choices]


def test_best_of_returns_the_likeliest_of_its_sequences(client):
    kw = dict(model="tiny", prompt="w60 w61", max_tokens=8, temperature=1.5, seed=11)
    every = client.completions.create(**kw, n=4, logprobs=0)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    order = sorted(range(4), key=lambda i: -mean[i])
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in best.choices] == [every.choices[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 4 generated


# ---- tool history and refused fields ----------------------------------------------------------


def test_tool_history_is_accepted(client):
    messages = [
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "w7"},
    ]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    assert e.value.body["param"] == "tools"
    r = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                       tool_choice="none", max_tokens=4)  # fmt: skip
    assert r.choices[0].message.content is not None


# ---- text the tokenizer cannot take -----------------------------------------------------------

SURROGATE_BODIES = {
    "chat": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]%s}',
             "messages.0.content"),
    "completions": ("/v1/completions", '{"prompt": "a\\ud800"%s}', "prompt"),
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", list(SURROGATE_BODIES))
def test_lone_surrogate_is_a_400_and_the_connection_lives_on(servers, endpoint, stream):
    path, template, param = SURROGATE_BODIES[endpoint]
    body = template % (', "max_tokens": 2, "stream": true' if stream else ', "max_tokens": 2')
    srv = servers["async"]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    headers = {"content-type": "application/json"}
    conn.request("POST", path, body=body.encode(), headers=headers)
    r = conn.getresponse()
    err = json.loads(r.read())["error"]
    assert r.status == 400 and err["param"] == param and "surrogate" in err["message"]
    sock = conn.sock
    good = json.dumps({"prompt": "w5", "max_tokens": 2}).encode()
    conn.request("POST", "/v1/completions", body=good, headers=headers)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["choices"][0]["text"]
    assert conn.sock is sock  # the same keep-alive connection answered
    conn.close()


def test_tokenizer_failures_are_400s(servers, monkeypatch):
    tok = tok_of(servers["async"])

    def refuse(*a, **kw):
        raise TypeError("TextEncodeInput must be Union[...]")

    monkeypatch.setattr(type(tok), "__call__", refuse)
    for path, body in [
        ("/v1/completions", {"prompt": "w5"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
    ]:
        r = httpx.post(servers["async"].url + path, json=body)
        assert r.status_code == 400 and "tokenizer refused" in r.json()["error"]["message"]


# ---- penalties and logit_bias -----------------------------------------------------------------


def test_penalties_and_bias_are_applied_alike_in_ar_and_async(servers, tiny_pair_dir):
    """Greedy under frequency/presence/repetition penalties and a logit_bias (min_p changes no
    greedy choice): both servers give the tokens of plain decoding under the documented rule,
    and the rule changed them."""
    from conftest import reference_ruled

    from sglang_d3d.config import SamplingParams
    from sglang_d3d.models.loading import load_hf_model

    rules = dict(frequency_penalty=1.5, presence_penalty=0.8, logit_bias={"42": 4.0, "8": -3.0},
                 extra_body={"repetition_penalty": 1.3, "min_p": 0.2})  # vLLM's names
    got, logprobs = {}, {}
    for mode, srv in servers.items():
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=16, temperature=0, logprobs=0)
        lp = c.completions.create(**kw, **rules).choices[0].logprobs
        got[mode], logprobs[mode] = lp.tokens, lp.token_logprobs
        plain = c.completions.create(**kw).choices[0].logprobs.tokens
    assert got["ar"] == got["async"] and got["ar"] != plain
    hf = load_hf_model(Path(tiny_pair_dir[0])).double()
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.8, repetition_penalty=1.3,
                            logit_bias=((8, -3.0), (42, 4.0)))
    ids = tok_of(servers["ar"]).convert_tokens_to_ids(got["ar"])
    assert ids == reference_ruled(hf, PROMPT_IDS, 16, params)
    raw = plain_forward_logprobs(tiny_pair_dir[0], PROMPT_IDS, ids)  # the rules never touch them
    for mode in servers:
        assert logprobs[mode] == pytest.approx(raw, abs=1e-9)


def test_a_strong_bias_forces_its_token_through_the_stream(servers, client):
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=6,
        temperature=0.7, seed=3, logit_bias={"42": 100}, stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    word = tok_of(servers["async"]).decode([42]).strip()  # the test tokenizer's words: " w42"
    assert text.split() == [word] * 6


def test_ignore_eos_and_min_tokens(servers, client):
    """A bias forcing the end-of-sequence token: it ends the answer at once, unless ignored
    (then every token is it, to max_tokens) or held back by min_tokens (vLLM's fields)."""
    eos = tok_of(servers["async"]).eos_token_id
    kw = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
              logit_bias={str(eos): 100})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    r = client.completions.create(**kw, extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 6


def test_stop_token_ids_end_the_answer_and_ignore_eos_keeps_them(client):
    kw = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=0, logit_bias={"42": 100})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"  # 42 is no stop token by itself
    for extra in ({"stop_token_ids": [42]}, {"stop_token_ids": [42], "ignore_eos": True}):
        r = client.completions.create(**kw, extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_min_tokens_exempts_the_first_tokens_from_stop_strings(servers, client):
    word = tok_of(servers["async"]).decode([42]).strip()
    kw = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
              logit_bias={"42": 100}, stop=[word])
    assert client.completions.create(**kw).choices[0].text.strip() == ""  # stopped at once
    r = client.completions.create(**kw, extra_body={"min_tokens": 3})
    assert r.choices[0].text.split() == [word] * 3 and r.choices[0].finish_reason == "stop"
