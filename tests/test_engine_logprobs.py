"""Log-probabilities from the verify logits, and `n` choices sharing one prefill."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import reference_greedy
from engine_helpers import OracleDrafter, make_engine

from sglang_d3d.api import GenerationRequest, TokenEvent
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.speculative.logprobs import TokenLogprob, token_logprobs

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15]]


# ---- the pure function ------------------------------------------------------------------------


def test_token_logprobs_are_log_softmax_and_top_k_sorted():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 1.0]], dtype=torch.float64)
    out = token_logprobs(logits, [1, 2], k=3)
    ref = torch.log_softmax(logits, -1)
    assert [o.token_id for o in out] == [1, 2]
    assert out[0].logprob == pytest.approx(float(ref[0, 1]), abs=1e-12)
    assert out[1].logprob == pytest.approx(float(ref[1, 2]), abs=1e-12)
    assert [t for t, _ in out[0].top] == [0, 1, 2]
    assert [t for t, _ in out[1].top] == [2, 1, 3]
    assert out[1].top[0][1] == pytest.approx(float(ref[1, 2]), abs=1e-12)
    assert sum(math.exp(float(x)) for x in ref[0]) == pytest.approx(1.0)


def test_token_logprobs_without_alternatives_and_checks():
    logits = torch.randn(3, 10)
    out = token_logprobs(logits, [4, 0, 9], k=0)
    assert all(o.top == () for o in out) and all(o.logprob <= 0 for o in out)
    assert token_logprobs(torch.zeros(0, 10), [], 5) == []
    with pytest.raises(ValueError):
        token_logprobs(logits, [1, 2], 1)  # rows and tokens differ
    with pytest.raises(ValueError):
        token_logprobs(logits, [1, 2, 3], 21)  # OpenAI allows at most 20
    half = token_logprobs(logits.half(), [4, 0, 9], 2)  # low precision is lifted to float32
    assert half[0].logprob == pytest.approx(out[0].logprob, abs=2e-2)


# ---- through the engine -----------------------------------------------------------------------


def run(engine, requests: list[GenerationRequest], together: bool = False) -> dict[str, list]:
    """Step the engine until all finish; request id -> its events."""
    events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    if together:
        engine.submit_all(requests)
    else:
        for r in requests:
            engine.submit(r)
    while engine.has_work():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    return events


def tokens_and_logprobs(evs: list[TokenEvent]) -> tuple[list[int], list[TokenLogprob]]:
    toks = [t for e in evs for t in e.token_ids]
    lps = [lp for e in evs for lp in (e.logprobs or [])]
    return toks, lps


@torch.no_grad()
def forward_logprobs(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """A plain forward pass of the target over prompt + output -> log p(out[j]) [T]."""
    ids = torch.tensor([prompt + out])
    logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
    return logp.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)


def greedy_requests(k: int, max_new: int = 20) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=max_new)
    return [GenerationRequest(f"r{i}", p, params, logprobs=k) for i, p in enumerate(PROMPTS)]


def test_greedy_logprobs_equal_in_ar_and_async_and_match_a_plain_forward(tiny_models):
    hf = tiny_models[0]
    ar = run(make_engine(tiny_models, Mode.AR), greedy_requests(5))
    eng = make_engine(tiny_models, Mode.ASYNC, block=5)
    OracleDrafter(eng, hf)  # long acceptances: many tokens scored by draft rows of the verify
    spec = run(eng, greedy_requests(5))
    assert sum(len(e.token_ids) > 1 for evs in spec.values() for e in evs) > 0
    for i, prompt in enumerate(PROMPTS):
        toks_ar, lp_ar = tokens_and_logprobs(ar[f"r{i}"])
        toks_sp, lp_sp = tokens_and_logprobs(spec[f"r{i}"])
        assert toks_ar == toks_sp == reference_greedy(hf, prompt, 20)
        assert [x.token_id for x in lp_ar] == toks_ar and len(lp_sp) == len(toks_sp)
        ref = forward_logprobs(hf, prompt, toks_ar)
        for a, s, r in zip(lp_ar, lp_sp, ref.tolist(), strict=True):
            assert a.logprob == pytest.approx(r, abs=1e-9)
            assert s.logprob == pytest.approx(a.logprob, abs=1e-9)
            assert [t for t, _ in s.top] == [t for t, _ in a.top]
            assert a.top[0][0] == a.token_id  # greedy: the emitted token is the likeliest
            assert len(a.top) == 5


def test_no_logprobs_unless_asked(tiny_models):
    reqs = [GenerationRequest("x", PROMPTS[0], SamplingParams(max_new_tokens=6))]
    evs = run(make_engine(tiny_models, Mode.SYNC), reqs)["x"]
    assert all(e.logprobs is None for e in evs)


def test_logprobs_are_cut_with_the_tokens_at_a_stop(tiny_models):
    hf = tiny_models[0]
    ref = reference_greedy(hf, PROMPTS[0], 12)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(ref[4],))
    req = GenerationRequest("s", PROMPTS[0], params, logprobs=0)
    toks, lps = tokens_and_logprobs(run(make_engine(tiny_models, Mode.ASYNC), [req])["s"])
    assert toks == ref[: ref.index(ref[4]) + 1]
    assert [x.token_id for x in lps] == toks


def test_n_choices_share_one_prefill_and_sample_as_if_alone(tiny_models):
    """Each choice forked from the shared prefill draws exactly what it draws alone."""
    prompt = PROMPTS[2]

    def requests(tag: str) -> list[GenerationRequest]:
        return [
            GenerationRequest(f"{tag}{i}", prompt, SamplingParams(2.0, max_new_tokens=16, seed=i))
            for i in range(3)
        ]

    eng = make_engine(tiny_models, Mode.ASYNC, batch=4)
    calls = []
    real_prefill = eng.target.prefill_chunks
    eng.target.prefill_chunks = lambda chunks, **kw: calls.append(len(chunks)) or real_prefill(
        chunks, **kw)
    together = run(eng, requests("n"), together=True)
    assert sum(calls) == 1  # one prompt chunk prefilled; the other choices fork it
    alone = {}
    for r in requests("a"):
        alone.update(run(make_engine(tiny_models, Mode.ASYNC, batch=4), [r]))
    outs = [tokens_and_logprobs(together[f"n{i}"])[0] for i in range(3)]
    assert outs == [tokens_and_logprobs(alone[f"a{i}"])[0] for i in range(3)]
    assert len({tuple(o) for o in outs}) > 1  # different seeds, different choices


def test_submit_all_is_all_or_nothing(tiny_models):
    from sglang_d3d.api import QueueFullError

    eng = make_engine(tiny_models, Mode.AR, max_queue=2)
    reqs = [GenerationRequest(f"q{i}", PROMPTS[0], SamplingParams()) for i in range(3)]
    with pytest.raises(QueueFullError):
        eng.submit_all(reqs)
    assert eng.num_waiting == 0


def test_fused_logprobs_are_the_targets(tiny_prod_models):
    """Fused mode scores emitted tokens with the verify rows of its one pass (oracle branches:
    long acceptances, so most tokens come from draft rows)."""
    from test_engine_fused import OracleBranches

    hf = tiny_prod_models[0]
    eng = make_engine(tiny_prod_models, Mode.FUSED, block=5, budget=1)
    OracleBranches(eng, hf)
    spec = run(eng, greedy_requests(3))
    assert sum(len(e.token_ids) > 1 for evs in spec.values() for e in evs) > 0
    for i, prompt in enumerate(PROMPTS):
        toks, lps = tokens_and_logprobs(spec[f"r{i}"])
        assert toks == reference_greedy(hf, prompt, 20)
        ref = forward_logprobs(hf, prompt, toks)
        assert [x.logprob for x in lps] == pytest.approx(ref.tolist(), abs=1e-9)
