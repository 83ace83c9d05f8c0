"""Structured output (speculative/grammar.py): the masks alone, then through every decoding
mode, where speculation must give exactly what plain constrained decoding gives."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar
from engine_helpers import assert_follows, make_engine

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import (
    JSON_OBJECT,
    GrammarSpec,
    Mode,
    SamplingParams,
)
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.grammar import (
    NEVER_ENDS,
    UNSUPPORTED,
    GrammarError,
    Grammars,
    allowed,
    constrain,
)
from sglang_d3d.speculative.grammar_finite import can_finish, productive, rules
from sglang_d3d.speculative.grammar_schema import unsupported
from sglang_d3d.speculative.sampling import target_probs
from sglang_d3d.speculative.tree import DraftTree
from sglang_d3d.testing import tiny_pieces

V = 96
EOS = 2
PIECES = tiny_pieces(V)
ID = {p: i for i, p in enumerate(PIECES)}
# Two tokens, the second's choices depending on the first, then the end.
PAIR = GrammarSpec("regex", "(a[b0]|b[a1])")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars.for_pieces(PIECES, [EOS])


def _fresh_row(grammars: Grammars, spec: GrammarSpec, written: list[int]) -> torch.Tensor:
    """The reference: a new matcher fed `written`, then one mask row."""
    m = xgrammar.GrammarMatcher(grammars.compile(spec))
    assert all(m.accept_token(t) for t in written)
    row = xgrammar.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(row, 0)
    return row[0]


# ---- the maths --------------------------------------------------------------------------------
def test_allowed_reads_bit_b_of_word_w_as_token_32w_plus_b():
    mask = torch.tensor([[0b101, 0, -1], [-1, -1, 0]], dtype=torch.int32)
    got = allowed(mask, 70)  # the last word is cut at the vocabulary
    assert got.shape == (2, 70)
    assert got[0].nonzero().flatten().tolist() == [0, 2, *range(64, 70)]
    assert got[1].nonzero().flatten().tolist() == list(range(64))


def test_constrain_puts_refused_tokens_at_minus_infinity_on_a_copy():
    logits = torch.randn(2, V, dtype=torch.float64)
    mask = xgrammar.allocate_token_bitmask(2, V)
    mask[0] = 0
    mask[0, 0] = 1 << 5  # row 0 allows token 5 alone; row 1 everything
    before = logits.clone()
    got = constrain(logits, mask)
    assert torch.equal(logits, before) and got.dtype == torch.float64
    assert got[0].argmax() == 5 and torch.isinf(got[0]).sum() == V - 1
    assert torch.equal(got[1], logits[1])
    assert constrain(logits, None) is logits


def test_chain_rows_are_the_grammars_masks_after_each_drafts_prefix(grammars):
    c = grammars.constraint(JSON_OBJECT)
    c.advance([ID['{"']])
    drafts = [ID["a"], ID['":'], ID[" "], ID["1"]]
    got = c.chain(drafts)
    for j in range(len(drafts) + 1):
        assert torch.equal(got[j], _fresh_row(grammars, JSON_OBJECT, [ID['{"'], *drafts[:j]]))
    assert torch.equal(c.chain(drafts), got)  # the matcher was rolled back


def test_rows_after_a_refused_draft_allow_everything(grammars):
    c = grammars.constraint(JSON_OBJECT)
    got = c.chain([ID["{"], ID["}"], ID["{"], ID["a"]])  # `{}` ends the object: `{` is refused
    assert torch.equal(got[2], _fresh_row(grammars, JSON_OBJECT, [ID["{"], ID["}"]]))
    assert not allowed(got[2:3], V)[0, ID["{"]]
    assert (got[3:] == -1).all()
    c.advance([ID["{"], ID["}"], EOS])  # the state is where the chain started


def test_tree_rows_follow_each_nodes_own_path(grammars):
    c = grammars.constraint(JSON_OBJECT)
    # root -> `{` -> (`}` | `"a"`), and `"a"` -> `:`
    tree = DraftTree((ID["{"], ID["}"], ID['"a"'], ID[":"]), (0, 1, 1, 3), (1, 2, 2, 3))
    got = c.tree(tree)
    paths = [[], [ID["{"]], [ID["{"], ID["}"]], [ID["{"], ID['"a"']],
             [ID["{"], ID['"a"'], ID[":"]]]
    for i, path in enumerate(paths):
        assert torch.equal(got[i], _fresh_row(grammars, JSON_OBJECT, path))


def test_a_finished_answer_allows_only_the_end(grammars):
    c = grammars.constraint(PAIR)
    got = allowed(c.chain([ID["a"], ID["b"], EOS, ID["a"]]), V)
    assert got[2].nonzero().flatten().tolist() == [EOS]
    assert got[3].all()  # after the end: unreachable, nothing masked


@pytest.mark.parametrize("spec,msg", [
    (GrammarSpec("json_schema", '{"type": 5}'), "invalid json_schema: Type should be a string"),
    (GrammarSpec("json_schema", "{not json"), "invalid json_schema"),
    (GrammarSpec("regex", "a("), "invalid regex: Regex parsing error"),
    (GrammarSpec("ebnf", "root ::= "), "invalid ebnf"),
])
def test_a_source_that_does_not_compile_is_a_grammar_error(grammars, spec, msg):
    with pytest.raises(GrammarError, match=msg):
        grammars.constraint(spec)


# ---- grammars that cannot finish, schemas held inexactly (grammar_finite.py, grammar_schema.py)
@pytest.mark.parametrize("ebnf, finishes", [
    ('root ::= "a" root', False),
    ('root ::= a\na ::= "x" b\nb ::= "y" a', False),
    ('root ::= x+\nx ::= "a" x', False),
    ('root ::= "a" | "b" root', True),
    ('root ::= x*\nx ::= "a" x', True),
    ('root ::= ("a" | "(") root | "[(]" (= "b")', True),
    ('root ::= x{2, 3} "y"?\nx ::= [a-z] | "(" x ")"', True),
    ('root ::= x{2, 3}\nx ::= "(" x ")"', False),
])  # fmt: skip
def test_a_grammar_finishes_iff_its_root_derives_a_finite_string(ebnf, finishes):
    assert can_finish(str(xgrammar.Grammar.from_ebnf(ebnf))) is finishes


def test_the_productive_rules_are_a_least_fixed_point():
    grammar = rules('root ::= ((a) | (b))\na ::= (("x" a))\nb ::= (("y" c{0, -1}))\nc ::= ((c))\n')
    assert productive(grammar) == {"root", "b"}


@pytest.mark.parametrize("spec, code", [
    (GrammarSpec("ebnf", 'root ::= "a" root'), NEVER_ENDS),
    (GrammarSpec("json_schema", json.dumps({"type": "object", "required": ["c"], "properties": {
        "c": {"$ref": "#"}}})), NEVER_ENDS),
    (GrammarSpec("json_schema", '{"not": {}}'), UNSUPPORTED),
    (GrammarSpec("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}'), UNSUPPORTED),
])  # fmt: skip
def test_grammars_that_cannot_be_held_exactly_or_finished_are_refused_with_a_code(grammars, spec, code):
    with pytest.raises(GrammarError) as e:
        grammars.compile(spec)
    assert e.value.code == code


@pytest.mark.parametrize("schema, keyword", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"properties": {"a": {"not": {}}}}, "not"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required"),
    ({"type": []}, "type"),
    ({"items": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "oneOf"),
    ({"$defs": {"A": {"uniqueItems": True}}}, "uniqueItems"),
    ({"const": 1, "type": "string"}, "const"),
])  # fmt: skip
def test_keywords_the_converter_would_drop_are_found_with_where_they_are(schema, keyword):
    found = unsupported(schema)
    assert found is not None and found.keyword == keyword


def test_schemas_held_exactly_pass_pydantics_among_them():
    import enum

    import pydantic

    class Unit(str, enum.Enum):
        c = "celsius"

    class Place(pydantic.BaseModel):
        city: str
        unit: Unit = Unit.c
        near: list[Place] | None = None

    assert unsupported(Place.model_json_schema()) is None
    tagged = {"oneOf": [
        {"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
        {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"]}]}
    for schema in (tagged, {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                   {"allOf": [{"type": "integer"}], "title": "t"}, {"uniqueItems": False}):
        assert unsupported(schema) is None, schema


def test_a_vocabulary_that_cannot_start_the_answer_is_a_clear_error():
    words = Grammars.for_pieces(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, V)], [EOS])
    with pytest.raises(GrammarError, match="allows no token of this vocabulary"):
        words.constraint(JSON_OBJECT).chain([])


@pytest.mark.parametrize("kw", [{"ignore_eos": True}, {"min_tokens": 2}])
def test_a_grammar_decides_the_end_so_ignore_eos_and_min_tokens_are_refused(kw):
    with pytest.raises(ValueError, match="cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(max_new_tokens=4, grammar=JSON_OBJECT, **kw)


@pytest.mark.parametrize("kind,source", [("yaml", "a"), ("regex", " ")])
def test_a_grammar_needs_a_known_kind_and_a_source(kind, source):
    with pytest.raises(ValueError, match="grammar kind must be one of|non-empty source"):
        GrammarSpec(kind, source)


# ---- through the engine -----------------------------------------------------------------------
PROMPTS = [[21, 22, 23, 24], [25, 26, 25, 26, 25, 26], [30, 40, 31, 50, 32, 60, 33], [70]]
SPECS = {"json": JSON_OBJECT, "regex": GrammarSpec("regex", r'\{"a": (0|1|true|null)(, "a": (0|1))*\}')}


def _engine(models, mode: Mode, grammars: Grammars, block: int = 4, **kw) -> SpecEngine:
    return make_engine(models, mode, block, eos_token_ids=(EOS,), grammars=grammars, **kw)


def _reference(hf, grammars: Grammars, spec: GrammarSpec, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding under the grammar, with plain HF forward passes."""
    m = xgrammar.GrammarMatcher(grammars.compile(spec))
    ids, out = list(prompt), []
    row = xgrammar.allocate_token_bitmask(1, V)
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != EOS):
            logits = hf(torch.tensor([ids])).logits[0, -1:]
            m.fill_next_token_bitmask(row, 0)
            tok = int(logits.masked_fill(~allowed(row, V), float("-inf")).argmax())
            assert m.accept_token(tok)
            out.append(tok)
            ids.append(tok)
    return out


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("trees", [True, False], ids=["trees", "chains"])
def test_every_mode_equals_plain_constrained_decoding(request, grammars, mode, trees, spec):
    models = request.getfixturevalue("tiny_prod_models" if mode is Mode.FUSED else "tiny_models")
    eng = _engine(models, mode, grammars, **({} if trees else {"tree_nodes": 0}))
    params = SamplingParams(max_new_tokens=24, grammar=SPECS[spec])
    outs = generate(eng, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.error is None
        assert out.token_ids == _reference(models[0], grammars, SPECS[spec], prompt, 24)
        m = xgrammar.GrammarMatcher(grammars.compile(SPECS[spec]))
        assert all(m.accept_token(t) for t in out.token_ids)  # inside the grammar throughout
        assert out.finish_reason == ("stop" if m.is_terminated() else "length")


def test_a_short_grammar_ends_the_answer_with_eos_in_every_mode(request, grammars):
    for mode in Mode:
        models = request.getfixturevalue("tiny_prod_models" if mode is Mode.FUSED else "tiny_models")
        out = generate(_engine(models, mode, grammars), [PROMPTS[0]],
                       SamplingParams(max_new_tokens=16, grammar=PAIR))[0]
        assert len(out.token_ids) == 3 and out.token_ids[-1] == EOS, mode
        assert PIECES[out.token_ids[0]] + PIECES[out.token_ids[1]] in ("ab", "a0", "ba", "b1")
        assert out.finish_reason == "stop"


def _pair_distribution(hf, grammars: Grammars, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2) under the target and PAIR, [V, V]: x2's mask depends on x1."""
    prompt = PROMPTS[0]
    with torch.no_grad():
        l1 = hf(torch.tensor([prompt])).logits[0, -1:]
        l2 = hf(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1]
    p1 = target_probs(constrain(l1, _fresh_row(grammars, PAIR, []).unsqueeze(0))[0], params)
    exact = torch.zeros(V, V, dtype=torch.float64)
    for x in (ID["a"], ID["b"]):
        mask = _fresh_row(grammars, PAIR, [x]).unsqueeze(0)
        exact[x] = p1[x] * target_probs(constrain(l2[x : x + 1], mask)[0], params)
    return exact


@pytest.mark.parametrize("mode,engine_kw", [(Mode.SYNC, {}), (Mode.ASYNC, {"tree_nodes": 0})],
                         ids=["sync-trees", "async-chains"])
def test_sampled_tokens_follow_the_constrained_target(tiny_models, grammars, mode, engine_kw):
    """The second token is verified speculatively; its law under the grammar depends on the
    first, and the joint law must be the constrained target's (chi-square)."""
    base = dict(temperature=2.0, max_new_tokens=2, grammar=PAIR)
    exact = _pair_distribution(tiny_models[0], grammars, SamplingParams(**base))
    n = 1200
    eng = _engine(tiny_models, mode, grammars, block=3, max_queue=n, **engine_kw)
    outs = generate(eng, [PROMPTS[0]] * n, [SamplingParams(**base, seed=s) for s in range(n)])
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    assert_follows(counts, exact.float(), n)
    assert counts.sum() == n and (exact > 0.05).sum() >= 3  # the law has several cells


def test_an_engine_without_a_compiler_refuses_a_grammar(tiny_models):
    eng = make_engine(tiny_models, Mode.ASYNC, 4)
    with pytest.raises(ValueError, match="structured output is not available"):
        eng.submit(GenerationRequest("r", [5, 6], SamplingParams(grammar=JSON_OBJECT)))


def test_a_bad_grammar_is_refused_at_submit(tiny_models, grammars):
    eng = _engine(tiny_models, Mode.SYNC, grammars)
    with pytest.raises(GrammarError, match="invalid regex"):
        eng.submit(GenerationRequest("r", [5, 6], SamplingParams(grammar=GrammarSpec("regex", "("))))


def test_a_tree_past_the_end_is_walked_without_touching_the_finished_matcher(grammars, capfd):
    c = grammars.constraint(PAIR)
    c.advance([ID["a"]])
    tree = DraftTree((ID["b"], EOS, EOS, ID["a"]), (0, 1, 2, 3), (1, 2, 3, 4))
    got = allowed(c.tree(tree), V)
    assert got[1].nonzero().flatten().tolist() == [EOS] and got[2:].all()
    assert "terminated" not in capfd.readouterr().err  # xgrammar warns on a token past the end
    c.advance([ID["b"], EOS])


# ---- steering the drafter ---------------------------------------------------------------------
def test_steered_slots_are_masked_along_their_own_likeliest_allowed_path(grammars):
    c = grammars.constraint(JSON_OBJECT)
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    got = c.steer(logits)
    path = got.argmax(-1).tolist()
    for j in range(5):  # row j: the grammar's mask after the path before it
        row = _fresh_row(grammars, JSON_OBJECT, path[:j]).unsqueeze(0)
        assert torch.equal(got[j], constrain(logits[j : j + 1], row)[0])
    c.advance([ID["{"]])  # the matcher was rolled back: `{` still opens the answer


def test_steering_starts_after_tokens_not_yet_emitted(grammars):
    c = grammars.constraint(PAIR)
    got = c.steer(torch.zeros(2, V), after=[ID["a"]]) > float("-inf")
    assert got[0].nonzero().flatten().tolist() == [ID["b"], ID["0"]]
    assert got[1].nonzero().flatten().tolist() == [EOS]
    c.advance([ID["a"], ID["0"]])


def test_steering_never_raises_and_leaves_what_the_grammar_cannot_judge(grammars):
    c = grammars.constraint(PAIR)
    logits = torch.randn(3, V)
    assert torch.equal(c.steer(logits, after=[ID["{"]]), logits)  # `{` is refused: no say
    finished = c.steer(logits, after=[ID["a"], ID["b"], EOS])  # past the end
    assert torch.equal(finished, logits)
    c.advance([ID["b"], ID["1"], EOS])


def test_constrain_is_the_same_through_xgrammars_kernel_and_the_unpacked_mask():
    logits = torch.randn(3, V)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)
    kernel = constrain(logits, mask)  # float32: xgrammar's kernel
    unpacked = constrain(logits.double(), mask)  # float64: the bits unpacked here
    assert torch.equal(torch.isinf(kernel), torch.isinf(unpacked))
    assert torch.equal(kernel, unpacked.float())
