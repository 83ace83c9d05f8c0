"""Structured output through the server (server/structured.py): `response_format` and SGLang's
`regex` and `ebnf`, answered inside the grammar and identical in ar and async mode; sources that
do not compile, and grammars the vocabulary cannot start, are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.config import Mode

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "w30 w40 w31"}]


@pytest.fixture(scope="module")
def clients(json_pair, tiny_pair_dir):
    servers = {m.value: ServerThread(create_app(tiny_server_config(json_pair, m))).start()
               for m in (Mode.AR, Mode.ASYNC)}
    words = ServerThread(create_app(tiny_server_config(tiny_pair_dir, Mode.ASYNC))).start()
    yield {name: openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
           for name, srv in {**servers, "words": words}.items()}
    for srv in (*servers.values(), words):
        srv.stop()


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48,
                                          temperature=0, **kw).choices[0]


def test_a_json_schema_answer_parses_and_follows_the_schema_in_both_modes(clients):
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}}
    got = {m: _chat(clients[m], response_format=fmt) for m in ("ar", "async")}
    assert got["ar"].message.content == got["async"].message.content
    assert got["async"].finish_reason == "stop"
    answer = json.loads(got["async"].message.content)
    assert set(answer) == {"a"} and isinstance(answer["a"], bool)


def test_json_object_answers_are_identical_in_both_modes_and_open_with_a_brace(clients):
    got = {m: _chat(clients[m], response_format={"type": "json_object"}) for m in ("ar", "async")}
    assert got["ar"].message.content == got["async"].message.content
    assert got["async"].message.content.startswith("{")
    if got["async"].finish_reason == "stop":
        assert isinstance(json.loads(got["async"].message.content), dict)


def test_sglangs_regex_and_ebnf_fields_constrain_completions(clients):
    for extra in ({"regex": "(a|b)(0|1)"}, {"ebnf": 'root ::= ("a" | "b") ("0" | "1")'}):
        r = clients["async"].completions.create(model="tiny", prompt=[21, 22, 23], max_tokens=16,
                                                temperature=0, extra_body=extra)
        assert r.choices[0].text in ("a0", "a1", "b0", "b1") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param, msg", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format", "invalid json_schema"),
    ({"regex": "a("}, "regex", "invalid regex"),
    ({"ebnf": "root ::= "}, "ebnf", "invalid ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a `json_schema`"),
    ({"response_format": {"type": "yaml"}}, "response_format", None),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None, "ignore_eos"),
])  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(clients, extra, param, msg):
    _assert_refused(clients["async"], extra, param, msg)


def _assert_refused(client, extra: dict, param: str | None, msg: str | None) -> None:
    """A 400 whose param starts with `param` (None: any) and whose message holds `msg`."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                       extra_body=extra)
    err = e.value.body
    assert param is None or (err.get("param") or "").startswith(param)
    assert msg is None or msg in err["message"]


def test_a_vocabulary_that_cannot_write_json_is_a_400(clients):
    with pytest.raises(openai.BadRequestError, match="allows no token of this vocabulary"):
        _chat(clients["words"], response_format={"type": "json_object"})


# ---- forced tool calls (server/tools.py) ------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "a", "description": "sets a flag", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}},
]


def test_a_required_tool_call_comes_back_as_tool_calls_in_both_modes(clients):
    got = {m: _chat(clients[m], tools=TOOLS, tool_choice="required") for m in ("ar", "async")}
    calls = {m: c.message.tool_calls for m, c in got.items()}
    assert [(c.function.name, c.function.arguments) for c in calls["ar"]] == \
        [(c.function.name, c.function.arguments) for c in calls["async"]]
    (call,) = calls["async"]
    assert got["async"].finish_reason == "tool_calls" and got["async"].message.content is None
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert call.function.name in ("a", "b")
    if call.function.name == "a":
        assert set(arguments) == {"a"} and isinstance(arguments["a"], bool)
    else:
        assert set(arguments) == {"b"} and isinstance(arguments["b"], int)


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_named_tool_is_the_one_called_and_streams_whole(clients, name):
    choice = {"type": "function", "function": {"name": name}}
    whole = _chat(clients["async"], tools=TOOLS, tool_choice=choice)
    assert [c.function.name for c in whole.message.tool_calls] == [name]
    stream = clients["async"].chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=48, temperature=0, tools=TOOLS,
        tool_choice=choice, stream=True)
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]


def test_a_streamed_call_carries_its_tokens_logprobs(clients):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=48, temperature=0, tools=TOOLS,
              tool_choice="required", logprobs=True)
    whole = clients["async"].chat.completions.create(**kw).choices[0]
    streamed = [c for chunk in clients["async"].chat.completions.create(**kw, stream=True)
                for c in chunk.choices if c.logprobs is not None]
    assert len(streamed) == 1 and streamed[0].delta.tool_calls
    assert [t.token for t in streamed[0].logprobs.content] == [t.token for t in whole.logprobs.content]


def test_a_call_cut_by_max_tokens_comes_back_as_text(clients):
    r = clients["async"].chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                                 temperature=0, tools=TOOLS, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert c.message.content.startswith("{")


@pytest.mark.parametrize("extra, param, msg", [
    ({"tools": TOOLS}, "tools", 'tool_choice "auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools", 'tool_choice "auto"'),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "c"}}},
     "tool_choice", "not in `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "at most one of"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools", None),
])  # fmt: skip
def test_tool_requests_that_cannot_be_served_are_400s(clients, extra, param, msg):
    _assert_refused(clients["async"], extra, param, msg)


def test_every_choice_and_every_streamed_piece_keeps_to_the_grammar(clients):
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}}
    r = clients["async"].chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48,
                                                 temperature=1.0, seed=3, n=3, response_format=fmt)
    for c in r.choices:  # sampled: each choice its own draws, each inside the schema
        assert c.finish_reason == "stop" and set(json.loads(c.message.content)) == {"a"}
    stream = clients["async"].chat.completions.create(model="tiny", messages=MESSAGES,
                                                      max_tokens=48, temperature=0,
                                                      response_format=fmt, stream=True)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == _chat(clients["async"], response_format=fmt).message.content
