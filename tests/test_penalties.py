"""Frequency, presence and repetition penalties, logit_bias and min-p (speculative/penalties.py,
sampling.py): the maths alone, then through every decoding mode, where speculation must give
exactly what plain decoding under the same rules gives."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import naive_rule, reference_greedy, reference_ruled
from engine_helpers import assert_follows, make_engine

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.penalties import (
    ban_stops,
    bias_vector,
    chain_ancestors,
    path_counts,
    penalize,
    reshape_chain,
    reshape_tree,
)
from sglang_d3d.speculative.sampling import target_probs
from sglang_d3d.speculative.tree import DraftTree

V = 96
RULES = SamplingParams(max_new_tokens=24, frequency_penalty=1.5, presence_penalty=0.8,
                       logit_bias=((7, 3.0), (11, -2.0)))
REPEAT = replace(RULES, repetition_penalty=1.8)  # vLLM's, over the prompt too
PENALTIES = replace(RULES, logit_bias=())  # no bias: the first token has nothing to change


def output_counts(tokens: list[int], vocab: int, device: str) -> torch.Tensor:
    """[V] float32: how often each token occurs in `tokens` (the reference counts)."""
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab).float()


def _written(prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(tokens=prompt + output, num_prompt=len(prompt), stop_ids=frozenset())


# ---- the maths --------------------------------------------------------------------------------
def test_chain_counts_add_the_drafts_before_each_row():
    base = output_counts([4, 4, 9], V, "cpu")
    drafts = [4, 2, 2]
    counts = path_counts(base, torch.tensor(drafts), chain_ancestors(len(drafts)))  # [4, V]
    for j in range(len(drafts) + 1):
        expect = output_counts([4, 4, 9] + drafts[:j], V, "cpu")
        assert torch.equal(counts[j], expect), j


def test_tree_counts_follow_each_nodes_own_path():
    # root -> 5 (node 1) -> 6 (node 3); root -> 6 (node 2) -> 6 (node 4)
    tree = DraftTree(tokens=(5, 6, 6, 6), parents=(0, 0, 1, 2), depths=(1, 1, 2, 2))
    counts = path_counts(output_counts([6], V, "cpu"), torch.tensor(tree.tokens),
                         torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                       [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool))
    paths = [[], [5], [6], [5, 6], [6, 6]]
    for node, path in enumerate(paths):
        assert torch.equal(counts[node], output_counts([6] + path, V, "cpu")), node


@pytest.mark.parametrize("params", [RULES, REPEAT], ids=["openai", "repetition"])
def test_penalize_is_the_documented_rule_row_by_row(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    prompt, written = [5, 3], [[], [3, 3, 7], [3, 11, 11, 11]]
    counts = torch.stack([output_counts(w, V, "cpu") for w in written])
    in_prompt = output_counts(prompt, V, "cpu") > 0
    before = logits.clone()
    got = penalize(logits, counts, params, in_prompt, bias_vector(params, torch.arange(V)))
    assert got.dtype == torch.float32 and torch.equal(logits, before)  # its input stays raw
    for row, w in enumerate(written):
        torch.testing.assert_close(got[row].double(), naive_rule(logits[row], w, params, prompt))


def test_repetition_shrinks_a_seen_tokens_logit_toward_zero_from_either_side():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    counts = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    in_prompt = torch.tensor([True, True, False, False])
    got = penalize(logits, counts, SamplingParams(repetition_penalty=2.0), in_prompt)
    assert got.tolist() == [[1.0, -4.0, 1.0, -4.0]]


@pytest.mark.parametrize("params", [RULES, REPEAT, PENALTIES], ids=["openai", "repetition", "penalties"])
def test_reshape_matches_the_rule_at_every_verify_row(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)  # a chain of 3 drafts
    prompt, output, drafts = [9, 7], [8, 3], [3, 7, 3]
    got = reshape_chain(logits, _written(prompt, output), drafts, params)
    for j in range(4):
        expect = naive_rule(logits[j], output + drafts[:j], params, prompt)
        torch.testing.assert_close(got[j].double(), expect)
    tree = DraftTree(tokens=(3, 7, 7), parents=(0, 0, 1), depths=(1, 1, 2))
    got = reshape_tree(logits, _written(prompt, output), tree, params)
    for node, path in enumerate([[], [3], [7], [3, 7]]):
        expect = naive_rule(logits[node], output + path, params, prompt)
        torch.testing.assert_close(got[node].double(), expect)


@pytest.mark.parametrize("params", [RULES, REPEAT, PENALTIES], ids=["openai", "repetition", "penalties"])
def test_the_first_token_sees_an_empty_output(params):
    logits = torch.randn(1, V)
    got = reshape_chain(logits, _written([9, 7], []), [], params)
    torch.testing.assert_close(got[0].double(), naive_rule(logits[0], [], params, [9, 7]))


def test_without_rules_the_logits_are_untouched():
    logits = torch.randn(3, V)
    assert reshape_chain(logits, _written([1], [2]), [3, 4], SamplingParams()) is logits
    assert not SamplingParams(frequency_penalty=0.0, logit_bias=(), min_p=0.3).reshapes_logits
    assert SamplingParams(repetition_penalty=0.9).reshapes_logits


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest():
    logits = torch.tensor([0.0, -1.0, -2.0, -3.0]).log_softmax(-1)  # probabilities known below
    p = torch.softmax(logits, -1)
    params = SamplingParams(temperature=1.0, min_p=float(p[2] / p[0]) - 1e-4)
    kept = target_probs(logits, params) > 0
    assert kept.tolist() == [True, True, True, False]
    torch.testing.assert_close(target_probs(logits, params)[:3], p[:3] / p[:3].sum())
    # greedy and the top token are never touched, even at min_p 1
    assert target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("kw,msg", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias values"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "unique"),
    ({"logit_bias": ((-1, 1.0),)}, "unique and >= 0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens"),
])
def test_out_of_range_rules_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


# ---- through the engine -----------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10], [12, 40, 13, 50, 14, 60, 15], [70]]


@pytest.mark.parametrize("params", [RULES, REPEAT, PENALTIES], ids=["openai", "repetition", "penalties"])
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("trees", [True, False], ids=["trees", "chains"])
def test_every_mode_equals_plain_decoding_under_the_rules(request, mode, trees, params):
    models = request.getfixturevalue("tiny_prod_models" if mode is Mode.FUSED else "tiny_models")
    hf = models[0]
    kw = {} if trees else {"tree_nodes": 0}
    outs = generate(make_engine(models, mode, 4, **kw), PROMPTS, params)
    changed = 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.error is None
        assert out.token_ids == reference_ruled(hf, prompt, 24, params)
        changed += out.token_ids != reference_greedy(hf, prompt, 24)
    assert changed >= 2  # the rules really steer this model, so the test has power


def test_a_banned_token_never_appears_and_a_forced_one_always_does(tiny_models):
    hf = tiny_models[0]
    liked = list(dict.fromkeys(reference_greedy(hf, PROMPTS[0], 16)))[:2]  # its first two tokens
    banned = SamplingParams(max_new_tokens=16, logit_bias=tuple((t, -100.0) for t in liked))
    out = generate(make_engine(tiny_models, Mode.ASYNC, 4), [PROMPTS[0]], banned)[0].token_ids
    assert not set(liked) & set(out) and len(out) == 16
    forced = SamplingParams(max_new_tokens=16, logit_bias=((42, 100.0),))
    out = generate(make_engine(tiny_models, Mode.SYNC, 4), [PROMPTS[0]], forced)[0].token_ids
    assert out == [42] * 16


def test_a_bias_outside_the_vocabulary_is_refused(tiny_models):
    eng = make_engine(tiny_models, Mode.ASYNC, 4)
    bad = SamplingParams(max_new_tokens=4, logit_bias=((V, 1.0),))
    with pytest.raises(ValueError, match="logit_bias token id out of the vocabulary"):
        eng.submit(GenerationRequest("r", [5, 6], bad))


def _ruled_pair_distribution(hf, params: SamplingParams, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2) under the target and the rules, [V, V]: x2's rule counts x1."""
    with torch.no_grad():
        l1 = naive_rule(hf(torch.tensor([prompt])).logits[0, -1], [], params, prompt)
        p1 = target_probs(l1, params)
        l2 = hf(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1]
        p2 = torch.stack([target_probs(naive_rule(l2[x], [x], params, prompt), params)
                          for x in range(V)])
    return p1.unsqueeze(1) * p2


@pytest.mark.parametrize("mode,engine_kw", [(Mode.SYNC, {}), (Mode.ASYNC, {"tree_nodes": 0})],
                         ids=["sync-trees", "async-chains"])
def test_sampled_tokens_follow_the_target_under_the_rules(tiny_models, mode, engine_kw):
    """The second token is verified speculatively; under a strong presence penalty its law
    depends on the first, and the joint law must be the ruled target's (chi-square)."""
    hf = tiny_models[0]
    base = dict(temperature=2.5, top_k=6, min_p=0.05, max_new_tokens=2, presence_penalty=2.0,
                repetition_penalty=1.2, logit_bias=((PROMPTS[0][0], 1.5),))
    exact = _ruled_pair_distribution(hf, SamplingParams(**base), PROMPTS[0])
    n = 1200
    eng = make_engine(tiny_models, mode, block=3, batch=8, max_queue=n, **engine_kw)
    outs = generate(eng, [PROMPTS[0]] * n, [SamplingParams(**base, seed=s) for s in range(n)])
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    assert_follows(counts, exact, n)
    # the rules really change the law (the test has power): repeats are rarer than without them
    plain = _ruled_pair_distribution(hf, SamplingParams(temperature=2.5, top_k=6, min_p=0.05),
                                     PROMPTS[0])
    assert float(exact.diagonal().sum()) < float(plain.diagonal().sum()) - 0.05



# ---- min_tokens and ignore_eos ----------------------------------------------------------------
def test_stops_are_banned_only_in_rows_before_min_tokens():
    logits = torch.zeros(4, V)
    params = SamplingParams(max_new_tokens=8, min_tokens=3)
    got = ban_stops(logits.clone(), torch.tensor([1, 2, 3, 4]), params, frozenset({5, 9}))
    assert torch.isinf(got[:2, [5, 9]]).all() and not torch.isinf(got[2:]).any()
    assert not torch.isinf(got[:2, [4, 6]]).any()
    # a chain whose root is output index 1 (two tokens out): rows pick indices 2, 3, 4, 5
    written = SimpleNamespace(tokens=[7, 8, 1, 2], num_prompt=2, stop_ids=frozenset({5}))
    got = reshape_chain(logits, written, [1, 1, 1], params)
    assert torch.isinf(got[0, 5]) and not torch.isinf(got[1:, 5]).any()


def _reference_min_tokens(hf, prompt: list[int], n: int, stop: int, min_tokens: int) -> list[int]:
    """Plain greedy decoding with `stop` banned before min_tokens, ending at `stop` after."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for i in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            if i < min_tokens:
                logits[stop] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] == stop:
                break
    return out


@pytest.mark.parametrize("mode", list(Mode))
def test_min_tokens_holds_a_stop_token_back_in_every_mode(request, mode):
    models = request.getfixturevalue("tiny_prod_models" if mode is Mode.FUSED else "tiny_models")
    hf = models[0]
    for prompt in PROMPTS[:2]:
        stop = reference_greedy(hf, prompt, 1)[0]  # the model's first choice: it would stop at once
        params = SamplingParams(max_new_tokens=24, min_tokens=10, stop_token_ids=(stop,))
        out = generate(make_engine(models, mode, 4), [prompt], params)[0]
        expect = _reference_min_tokens(hf, prompt, 24, stop, 10)
        assert out.token_ids == expect and stop not in expect[:10]
        assert out.finish_reason == ("stop" if expect[-1] == stop else "length")


def test_ignore_eos_runs_past_the_models_end_of_sequence(tiny_models):
    from sglang_d3d.config import EngineConfig, SpecConfig
    from sglang_d3d.engine.engine import SpecEngine

    hf, target, drafter = tiny_models
    eos = reference_greedy(hf, PROMPTS[0], 1)[0]
    cfg = EngineConfig(mode=Mode.ASYNC, spec=SpecConfig(4), max_batch_size=4, max_context=256)
    outs = [generate(SpecEngine(cfg, target, drafter, (eos,)), [PROMPTS[0]],
                     SamplingParams(max_new_tokens=12, ignore_eos=ignore))[0] for ignore in (False, True)]
    assert outs[0].token_ids == [eos] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == reference_greedy(hf, PROMPTS[0], 12)
    assert outs[1].finish_reason == "length"
