"""The real server (tiny random pair, async mode) driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    cfg = tiny_server_config(tiny_pair_dir, max_batch_size=8)
    with ServerThread(create_app(cfg)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def _prompt(rng: random.Random, n: int = 6) -> str:
    return " ".join(f"w{rng.randrange(3, 96)}" for _ in range(n))


def _chat(client, prompt: str, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], **kw
    )


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_completion_has_usage_finish_reason_and_d3d_stats(client):
    r = _chat(client, "w5 w6 w7", max_tokens=10, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert r.usage.completion_tokens == 10 and choice.finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    d3d = r.model_extra["d3d"]
    assert d3d["mode"] == "async" and d3d["num_cycles"] >= 1
    # block_size 4, or 1 + 8 where a cycle verified guesses copied from the text (lookup.py)
    assert 1.0 <= d3d["mean_accepted_length"] <= 1 + 8
    assert 0 <= d3d["copy_cycles"] <= d3d["num_cycles"]
    assert d3d["branch_hit_rate"] is None or 0.0 <= d3d["branch_hit_rate"] <= 1.0


def test_chat_stream_equals_non_stream(client):
    whole = _chat(client, "w9 w8 w7 w6", max_tokens=16, temperature=0)
    chunks = list(
        _chat(
            client,
            "w9 w8 w7 w6",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert "d3d" in [c for c in chunks if c.choices][-1].model_extra


def test_completion_stream_and_non_stream(client):
    whole = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    stream = client.completions.create(
        model="tiny", prompt="w20 w21", max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_completion_accepts_token_ids(client, srv):
    tok = srv.app.state.d3d.holder.get().tokenizer
    ids = tok("w20 w21", add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_trims_text_and_finishes_with_stop(client):
    free = _chat(client, "w40 w41 w42", max_tokens=16, temperature=0).choices[0].message.content
    words = free.split()
    stop = words[len(words) // 2]  # a word the greedy answer is known to contain
    cut = free[: free.index(stop)]
    r = _chat(client, "w40 w41 w42", max_tokens=16, temperature=0, stop=[stop, "never-seen"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    assert r.model_extra["d3d"]["num_cycles"] >= 1  # stats survive the abort a stop string makes
    chunks = list(
        _chat(client, "w40 w41 w42", max_tokens=16, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.9, extra_body={"top_k": 20})
    a = _chat(client, "w11 w12", seed=1234, **kw).choices[0].message.content
    b = _chat(client, "w11 w12", seed=1234, **kw).choices[0].message.content
    assert a == b


@pytest.mark.parametrize(
    "params", [{"top_p": 5e-324}, {"temperature": 1e-300}, {"temperature": 2.0, "top_k": 1}]
)
def test_extreme_but_legal_sampling_values_are_served(client, params):
    # schemathesis found these: the API allows them, so they must not fail the request.
    r = _chat(client, "w5 w6", max_tokens=6, seed=0, extra_body=params)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_32_concurrent_greedy_requests_equal_their_solo_runs(client, srv):
    rng = random.Random(0)
    prompts = [(_prompt(rng, rng.randrange(2, 12)), rng.randrange(4, 24)) for _ in range(32)]
    solo = [_chat(client, p, max_tokens=m, temperature=0) for p, m in prompts]

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        calls = [
            aclient.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=m,
                temperature=0,
            )
            for p, m in prompts
        ]
        try:
            return await asyncio.gather(*calls)
        finally:
            await aclient.close()

    together = asyncio.run(run_all())
    for a, b in zip(solo, together, strict=True):
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.choices[0].finish_reason == a.choices[0].finish_reason
        assert b.usage == a.usage
    assert srv.app.state.d3d.holder.get().num_running == 0


def test_sse_wire_format_ends_with_done(srv):
    body = {"prompt": "w5", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
