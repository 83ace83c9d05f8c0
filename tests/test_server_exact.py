"""Structured output is exact or refused (speculative/grammar_schema.py, grammar_finite.py): over a
corpus of schemas, every answer served with a 200 validates against its schema (`jsonschema`),
and every schema xgrammar would loosen is a 400 naming the keyword; grammars with no finite
answer are 400s; pydantic's tool schemas (`$defs` and `$ref` at the root) are served."""

from __future__ import annotations

import enum
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "w30 w40 w31"}]
DEADLINE = 120.0
SEEDS = 3  # sampled answers per schema (n), each validated

# Schemas the compiler holds exactly (or narrows): every finished answer must validate. The
# tiny vocabulary (sglang_d3d.testing.GRAMMAR_PIECES) writes the digits 0 and 1, `true`,
# `null` and the letters of "a b n m e r g u t s l", so every schema here can be written in them.
SERVED = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 10, "maximum": 110},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "maxItems": 3},
    {"type": "number", "exclusiveMinimum": 1, "maximum": 20},
    {"type": ["integer", "null"]},
    {"enum": ["a", "bb", 10, None]},
    {"type": "string", "enum": ["ab", "ba"]},
    {"const": {"a": [1, 0]}},
    {"type": "string", "minLength": 1, "maxLength": 3},
    {"type": "string", "pattern": "^[ab]{1,3}$"},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "null"}], "items": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
     "maxLength": 2}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"s": {"const": 1}},
     "required": ["s"]}]},
    {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "boolean"}]},
    {"oneOf": [
        {"type": "object", "properties": {"t": {"const": "a"}, "n": {"type": "integer"}},
         "required": ["t", "n"], "additionalProperties": False},
        {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"],
         "additionalProperties": False}]},
    {"allOf": [{"type": "integer", "maximum": 9}]},
    {"$defs": {"N": {"type": "object", "properties": {"nest": {"$ref": "#/$defs/N"}}}},
     "$ref": "#/$defs/N"},
    {"type": "object", "properties": {"ls": {"type": "array", "items": {"type": "object",
     "properties": {"a": {"type": "null"}}, "required": ["a"]}, "maxItems": 2}}, "required": ["ls"]},
]  # fmt: skip

# Schemas xgrammar would loosen or cannot satisfy: a 400 naming the keyword.
REFUSED = [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"not": {}}, "not"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required"),
    ({"type": "object", "required": ["a"]}, "required"),
    ({"type": []}, "type"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if"),
    ({"type": "string", "enum": ["a", 1]}, "enum"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "minimum": 5}, "$ref"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "integer"}, "anyOf"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
]  # fmt: skip

NEVER_ENDS = [
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", 'root ::= a\na ::= "x" b\nb ::= "y" a'),
    ("json_schema", {"$defs": {"N": {"type": "object", "properties": {"c": {"$ref": "#/$defs/N"}},
                                     "required": ["c"]}}, "$ref": "#/$defs/N"}),
    ("json_schema", {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"},
                                                            "minItems": 1}}, "required": ["c"]}),
]  # fmt: skip


@pytest.fixture(scope="module")
def srv(json_pair):
    with ServerThread(create_app(tiny_server_config(json_pair))) as s:
        yield s


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=DEADLINE,
                      json={"model": "tiny", "messages": MESSAGES, **body})


@pytest.mark.parametrize("schema", SERVED, ids=[json.dumps(s)[:60] for s in SERVED])
def test_every_answer_served_validates_against_its_schema(srv, schema):
    r = _post(srv, {"response_format": _fmt(schema), "max_tokens": 96, "temperature": 1.0,
                    "seed": 7, "n": SEEDS})
    assert r.status_code == 200, r.text
    finished = 0
    for choice in r.json()["choices"]:
        if choice["finish_reason"] != "stop":
            continue  # cut by max_tokens: not an answer, and said so
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        finished += 1
    assert finished, "no answer finished within max_tokens"


@pytest.mark.parametrize("schema, keyword", REFUSED, ids=[k for _, k in REFUSED])
def test_a_schema_held_inexactly_is_a_400_naming_the_keyword(srv, schema, keyword):
    r = _post(srv, {"response_format": _fmt(schema), "max_tokens": 8})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["code"] == "schema_unsupported"
    assert f"`{keyword}`" in err["message"]


@pytest.mark.parametrize("kind, source", NEVER_ENDS, ids=["self", "mutual", "ref", "items"])
def test_a_grammar_with_no_finite_answer_is_a_400_naming_the_field(srv, kind, source):
    body = ({"ebnf": source} if kind == "ebnf" else {"response_format": _fmt(source)})
    r = _post(srv, {**body, "max_tokens": 8})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == next(iter(body)) and err["code"] == "grammar_never_ends"


# ---- pydantic's tool schemas (names and values in the tiny vocabulary's letters) ---------------
class Measure(str, enum.Enum):
    metre = "metre"
    gram = "gram"


class Amount(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=4)
    measure: Measure


def _model(name: str, **fields) -> type[pydantic.BaseModel]:
    return pydantic.create_model(name, **fields)


RULES = _model("rules", base=(Amount, ...), ten=(int, pydantic.Field(ge=0, le=11)),
               alts=(list[Amount], pydantic.Field(max_length=1)))


def test_a_pydantic_tool_is_called_with_arguments_that_validate(srv):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    tool = openai.pydantic_function_tool(RULES)
    schema = tool["function"]["parameters"]
    assert "$defs" in schema and '"#/$defs/Amount"' in json.dumps(schema)  # refs at the root
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=140,
                                       temperature=1.0, seed=3, n=SEEDS, tools=[tool],
                                       tool_choice="required")
    calls = [c.message.tool_calls[0] for c in r.choices if c.finish_reason == "tool_calls"]
    assert calls, "no call finished within max_tokens"
    for call in calls:
        assert call.function.name == "rules"
        RULES.model_validate_json(call.function.arguments)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # The same schema as response_format: served, and held to the same rules.
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=140,
                                       temperature=1.0, seed=3, n=SEEDS,
                                       response_format=_fmt(schema))
    answers = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert answers, "no answer finished within max_tokens"
    for answer in answers:
        RULES.model_validate_json(answer)


def test_pydantic_tools_whose_definitions_share_a_name_keep_their_own(srv):
    # Two different models both called `Item`: each tool's `$defs` holds its own `Item`.
    flag = _model("Item", at=(bool, ...))
    size = _model("Item", n=(int, pydantic.Field(ge=0, le=11)))
    lane = _model("lane", seat=(flag, ...))
    bus = _model("bus", seat=(size, ...))
    tools = [openai.pydantic_function_tool(lane), openai.pydantic_function_tool(bus)]
    assert all("Item" in t["function"]["parameters"]["$defs"] for t in tools)
    for model in (lane, bus):
        r = _post(srv, {"tools": tools, "tool_choice": {"type": "function", "function": {
            "name": model.__name__}}, "max_tokens": 48, "temperature": 1.0, "seed": 1, "n": SEEDS})
        assert r.status_code == 200, r.text
        calls = [c["message"]["tool_calls"][0] for c in r.json()["choices"]
                 if c["finish_reason"] == "tool_calls"]
        assert calls, "no call finished within max_tokens"
        for call in calls:
            assert call["function"]["name"] == model.__name__
            model.model_validate_json(call["function"]["arguments"])
