"""Server features one piece at a time: tool history through the real SmolLM2 template, token names for
log-probabilities, refused fields, body parsing, API keys, best_of and refusal reasons."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sglang_d3d.server.auth import bearer_token, key_matches, keys_from_env
from sglang_d3d.server.body import CHUNK, parse_body
from sglang_d3d.server.errors import APIError, rejection_reason
from sglang_d3d.server.inputs import chat_prompt_ids, logit_bias, render_turns
from sglang_d3d.server.logprobs_out import (
    ScoredToken,
    TokenTexts,
    completion_logprobs,
    token_string,
)
from sglang_d3d.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from sglang_d3d.server.responses import Answer
from sglang_d3d.server.serving import best_answers, choice_params
from sglang_d3d.server.unsupported import check_logit_rules, check_supported

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.logprobs import TokenLogprob
from sglang_d3d.testing import tiny_tokenizer

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default target's own tokenizer (byte-level BPE, ChatML template)."""
    from sglang_d3d.models.loading import default_target_path, load_tokenizer

    return load_tokenizer(default_target_path())


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


# ---- tool history -----------------------------------------------------------------------------


def test_smollm2_template_renders_tool_history(smollm2_tokenizer):
    """SmolLM2's template knows no tool_calls: the call is written into the assistant turn as a
    <tool_call> block and the result is a ChatML `tool` turn."""
    tok = smollm2_tokenizer
    assert "tool_calls" not in tok.chat_template
    text = tok.decode(chat_prompt_ids(tok, messages(HISTORY)))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" in text


def test_templates_that_know_tool_calls_get_them_structured():
    turns = render_turns(messages(HISTORY), structured_tools=True)
    assert turns[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert turns[1]["content"] == ""
    assert turns[2] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    folded = render_turns(messages([{**HISTORY[1], "content": "Let me add."}]), False)
    assert folded[0]["content"].startswith("Let me add.\n<tool_call>")


def test_arguments_that_are_not_json_pass_through_as_text():
    bad = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    turn = render_turns(messages([{"role": "assistant", "tool_calls": [bad]}]), True)[0]
    assert turn["tool_calls"][0]["function"]["arguments"] == "not json"


# ---- token names ------------------------------------------------------------------------------


def test_byte_level_tokens_are_named_by_their_bytes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    names = TokenTexts(tok)
    ids = tok("héllo €", add_special_tokens=False)["input_ids"]
    raw = b"".join(bytes(names(i)[1]) for i in ids)
    assert raw == "héllo €".encode()  # the bytes of the tokens spell the text exactly
    partial = [i for i in ids if not _utf8(bytes(names(i)[1]))]
    for i in partial:  # a token ending inside a character is spelled by its bytes
        assert names(i)[0].startswith("bytes:\\x")


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_word_level_tokens_and_completion_shape():
    names = TokenTexts(tiny_tokenizer())
    assert names(5) == ("w5", list(b"w5"))
    scored = [ScoredToken(TokenLogprob(5, -0.5, ((6, -0.1), (7, -2.0))), 0),
              ScoredToken(TokenLogprob(7, float("-inf"), ()), 3)]  # fmt: skip
    lp = completion_logprobs(scored, names)
    assert lp.tokens == ["w5", "w7"] and lp.text_offset == [0, 3]
    # the sampled token is always among top_logprobs; -inf (not JSON) becomes a floor
    assert lp.top_logprobs[0] == {"w6": -0.1, "w7": -2.0, "w5": -0.5}
    assert lp.token_logprobs[1] == -9999.0 and lp.top_logprobs[1] == {"w7": -9999.0}
    assert token_string(b"\xe2\x82") == "bytes:\\xe2\\x82" and token_string(b"ok") == "ok"


# ---- fields this server cannot honour ---------------------------------------------------------


@pytest.mark.parametrize("extra", [
    {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
    {"tool_choice": "auto", "parallel_tool_calls": True},
    {"response_format": {"type": "text"}, "modalities": ["text"], "store": False},
    {"user": "u1", "metadata": {"k": "v"}, "service_tier": "auto"},
    {"stream": True, "stream_options": {"include_usage": True}},
])  # fmt: skip
def test_neutral_values_are_accepted(extra):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **extra})
    check_supported(body)
    check_logit_rules(object(), body)  # a backend without the rules takes their neutral values


def test_neutral_logit_rules_pass_any_backend():
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "ignore_eos": True}
    check_logit_rules(object(), ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **neutral}))


@pytest.mark.parametrize("extra, param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1.0}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"min_tokens": 3}, "min_tokens"),
])  # fmt: skip
def test_logit_rules_need_a_backend_that_applies_them(extra, param):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **extra})
    with pytest.raises(APIError) as e:
        check_logit_rules(object(), body)  # a backend that names no rules
    assert e.value.status == 400 and e.value.param == param
    check_logit_rules(SimpleNamespace(logit_rules=frozenset({param})), body)


def test_each_backend_names_the_rules_it_applies():
    from sglang_d3d.engine.loop import EngineLoop
    from sglang_d3d.sglang_worker.backend import SGLangEngineLoop

    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "repetition_penalty": 1.2})
    check_logit_rules(EngineLoop, body)
    with pytest.raises(APIError, match="repetition_penalty"):  # SGLang counts it differently
        check_logit_rules(SGLangEngineLoop, body)
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "min_tokens": 2})
    with pytest.raises(APIError, match="min_tokens"):  # the D3D worker refuses min_new_tokens
        check_logit_rules(SGLangEngineLoop, body)
    ruled = {"frequency_penalty": 0.5, "logit_bias": {"5": 1}, "min_p": 0.1}
    check_logit_rules(SGLangEngineLoop, ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **ruled}))


def test_logit_bias_keys_become_token_ids_checked_against_the_vocabulary():
    assert logit_bias({"7": 1.5, "3": -100.0}, 10) == ((3, -100.0), (7, 1.5))
    assert logit_bias(None, 10) == ()
    for bad in ({"10": 1.0}, {"7": 1.0, "07": 2.0}):
        with pytest.raises(APIError) as e:
            logit_bias(bad, 10)
        assert e.value.param == "logit_bias"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"function_call": "auto"}, "function_call"),
    ({"service_tier": "flex"}, "service_tier"),
])  # fmt: skip
def test_fields_that_ask_for_something_are_refused_by_name(extra, param):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **extra})
    with pytest.raises(APIError) as e:
        check_supported(body)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_best_of_checks():
    check_supported(CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 4}))
    body = CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 4})
    assert body.num_sequences == 4


# ---- bodies -----------------------------------------------------------------------------------


def test_large_message_lists_are_validated_in_chunks_keeping_error_positions():
    msgs = [{"role": "user", "content": f"w{i % 90 + 3}"} for i in range(3 * CHUNK + 7)]
    ok = parse_body(json.dumps({"messages": msgs}).encode(), ChatCompletionRequest)
    assert len(ok.messages) == len(msgs) and ok.messages[-1].content == msgs[-1]["content"]
    msgs[2 * CHUNK + 3] = {"role": "robot", "content": "x"}
    with pytest.raises(APIError) as e:
        parse_body(json.dumps({"messages": msgs}).encode(), ChatCompletionRequest)
    assert e.value.param == f"messages.{2 * CHUNK + 3}.role"


def test_long_token_id_prompts_are_validated_in_chunks():
    from sglang_d3d.server.body import ID_CHUNK

    ids = [i % 90 + 3 for i in range(2 * ID_CHUNK + 5)]
    ok = parse_body(json.dumps({"prompt": ids}).encode(), CompletionRequest)
    assert ok.prompt == ids
    ids[ID_CHUNK + 9] = -1
    with pytest.raises(APIError) as e:
        parse_body(json.dumps({"prompt": ids}).encode(), CompletionRequest)
    assert e.value.param == f"prompt.{ID_CHUNK + 9}"


def test_big_bodies_decode_like_small_ones():
    from sglang_d3d.server.body import PYTHON_SCANNER_ABOVE, decode_json

    doc = {"prompt": "w5 " * PYTHON_SCANNER_ABOVE, "t": float("nan"), "s": "a\ud800é"}
    raw = json.dumps(doc).encode()
    assert len(raw) > PYTHON_SCANNER_ABOVE
    out = decode_json(raw)
    assert out["prompt"] == doc["prompt"] and out["s"] == doc["s"] and out["t"] != out["t"]


@pytest.mark.parametrize("raw, code", [
    (b"", "missing"), (b"[1]", "model_attributes_type"), (b"{", "json_invalid"),
    (b'{"prompt": "\xff"}', "json_invalid"),
])  # fmt: skip
def test_bodies_that_are_not_json_objects(raw, code):
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and e.value.code == code


# ---- API keys, choices, refusal reasons -------------------------------------------------------


def test_api_key_parsing_and_comparison():
    assert keys_from_env({"D3D_API_KEY": " k1, k2 ,,"}) == ("k1", "k2")
    assert keys_from_env({}) == ()
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    assert key_matches("k2", ("k1", "k2")) and not key_matches("k3", ("k1", "k2"))
    assert not key_matches("k", ())


def test_choices_get_their_own_seeds():
    p = SamplingParams(temperature=1.0, seed=2**63 - 1)
    assert [c.seed for c in choice_params(p, 3)] == [2**63 - 1, 0, 1]
    assert choice_params(SamplingParams(), 2) == [SamplingParams()] * 2


def test_best_answers_keep_the_highest_logprob_per_token():
    answers = [Answer(i, f"t{i}", "stop") for i in range(4)]
    best = best_answers(answers, [-2.0, -0.5, -3.0, -1.0], 2)
    assert [(a.index, a.text) for a in best] == [(0, "t1"), (1, "t3")]
    assert best_answers(answers[:2], [-1.0, -2.0], 2) == answers[:2]


@pytest.mark.parametrize("status, code, reason", [
    (413, "body_too_large", "body_too_large"), (401, None, "unauthorized"),
    (503, "queue_full", "queue_full"), (400, "context_length_exceeded", "too_long"),
    (503, "loading", "unavailable"), (400, "finite_number", "bad_request"),
    (404, "model_not_found", "bad_request"), (500, None, None),
])  # fmt: skip
def test_rejection_reasons(status, code, reason):
    assert rejection_reason(status, code) == reason


def test_byte_level_alphabet_is_gpt2s():
    from sglang_d3d.server.logprobs_out import byte_level_alphabet
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_level_alphabet() == bytes_to_unicode()
    assert set(byte_level_alphabet().values()) == set(ByteLevel.alphabet())


def test_structured_output_needs_a_backend_with_a_grammar_compiler():
    from sglang_d3d.server.structured import check_grammar, grammar_spec

    from sglang_d3d.config import JSON_OBJECT, GrammarSpec
    from sglang_d3d.engine.loop import EngineLoop
    from sglang_d3d.sglang_worker.backend import SGLangEngineLoop

    body = ChatCompletionRequest.model_validate(
        {"messages": HISTORY[:1], "response_format": {"type": "json_object"}})
    assert grammar_spec(body) == (JSON_OBJECT, "response_format")
    assert hasattr(EngineLoop, "compile_grammar")
    with pytest.raises(APIError, match="not supported by this server's backend") as e:
        check_grammar(SGLangEngineLoop, grammar_spec(body))
    assert e.value.param == "response_format"
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert grammar_spec(body) == (GrammarSpec("json_schema", json.dumps(schema)), "response_format")
    for free in ({}, {"response_format": {"type": "text"}}):
        assert grammar_spec(ChatCompletionRequest.model_validate({"messages": HISTORY[:1], **free})) is None


# ---- forced tool calls ------------------------------------------------------------------------
def test_a_forced_call_is_one_call_of_the_allowed_tools_as_a_schema():
    from sglang_d3d.server.protocol import Tool
    from sglang_d3d.server.tools import NO_ARGUMENTS, call_grammar, forced_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    body = ChatCompletionRequest.model_validate(
        {"messages": HISTORY[:1], "tools": tools, "tool_choice": "required"})
    schema = json.loads(call_grammar(forced_tools(body)).source)
    assert [c["properties"]["name"] for c in schema["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert schema["anyOf"][1]["properties"]["arguments"] == NO_ARGUMENTS  # g takes none
    assert all(c["required"] == ["name", "arguments"] for c in schema["anyOf"])
    named = body.model_copy(update={"tool_choice": {"type": "function", "function": {"name": "g"}}})
    named = ChatCompletionRequest.model_validate(named.model_dump())
    assert [t.function.name for t in forced_tools(named)] == ["g"]
    for text_only in ("none", "auto", None):
        body = ChatCompletionRequest.model_validate(
            {"messages": HISTORY[:1], "tools": tools, "tool_choice": text_only})
        assert forced_tools(body) is None
    assert isinstance(forced_tools(named)[0], Tool)


def test_a_call_parses_into_openais_tool_calls_or_not_at_all():
    from sglang_d3d.server.tools import parse_call

    (call,) = parse_call('{"name": "f", "arguments": {"x": [1, 2]}}')
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"x": [1, 2]}
    assert call.id.startswith("call_") and call.type == "function"
    for cut in ('{"name": "f", "argu', "", '{"name": "f"}', "[1]"):
        assert parse_call(cut) is None


def test_templates_without_tools_get_them_in_a_system_turn():
    from sglang_d3d.server.inputs import with_system
    from sglang_d3d.server.protocol import Tool
    from sglang_d3d.server.tools import tools_turn

    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "description": "d"}})
    turn = tools_turn([tool])
    assert turn["role"] == "system" and '{"type": "function", "function": {"name": "f", ' \
        '"description": "d"}}' in turn["content"]
    user = {"role": "user", "content": "hi"}
    assert with_system([user], turn) == [turn, user]
    joined = with_system([{"role": "system", "content": "be brief"}, user], turn)
    assert joined[0]["content"] == "be brief\n\n" + turn["content"] and joined[1] == user


def test_the_tools_reach_the_prompt_through_the_template_or_a_system_turn(smollm2_tokenizer):
    from sglang_d3d.server.protocol import Tool

    tool = Tool.model_validate({"type": "function", "function": {"name": "lookup_price"}})
    text = smollm2_tokenizer.decode(chat_prompt_ids(smollm2_tokenizer, messages(HISTORY[:1]), [tool]))
    assert "<|im_start|>system\n" in text and '"name": "lookup_price"' in text  # SmolLM2: no tools

    class KnowsTools:  # a template that renders `tools` itself
        chat_template = "{% for t in tools %}{{ t }}{% endfor %}"
        seen: dict = {}

        def apply_chat_template(self, turns, **kw):
            self.seen.update(kw, turns=turns)
            return "rendered"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [7, 8]}

    tok = KnowsTools()
    assert chat_prompt_ids(tok, messages(HISTORY[:1]), [tool]) == [7, 8]
    assert tok.seen["tools"] == [{"type": "function", "function": {"name": "lookup_price"}}]
    assert all(t["role"] != "system" for t in tok.seen["turns"])
