"""Faults and limits: a failing drafter costs no token; the context limit is enforced."""

from __future__ import annotations

import engine_helpers
import pytest
import torch
from conftest import layout_models, reference_greedy
from engine_helpers import mode_layouts

from sglang_d3d.api import RequestTooLongError
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate

PROMPT = [5, 6, 7, 8]


def make_engine(*args, **kw):
    """The drafter must run for its faults to show: tiny models repeat themselves, and guesses
    copied from the text (lookup_tokens: alone, or in its trees) would leave it idle or finish
    the requests in a few cycles."""
    return engine_helpers.make_engine(*args, lookup_tokens=0, **kw)


def _break_after(engine, calls: int, how: str):
    runner = engine.drafting.runner
    real = runner.run
    count = {"n": 0}

    def run(rows):
        count["n"] += 1
        if count["n"] <= calls:
            return real(rows)
        if how == "raise":
            raise RuntimeError("drafter exploded")
        return [torch.full_like(x, float("nan")) for x in real(rows)]

    runner.run = run
    return count


@pytest.mark.parametrize("layout,block", [("tiny", 4), ("production", 16)])
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
@pytest.mark.parametrize("how", ["raise", "nan"])
def test_drafter_failure_mid_request_loses_nothing(request, layout, block, mode, how):
    models = layout_models(request, layout)
    eng = make_engine(models, mode, block=block)
    _break_after(eng, calls=4, how=how)
    out = generate(eng, [PROMPT, [9, 10]], SamplingParams(max_new_tokens=30))
    for prompt, o in zip([PROMPT, [9, 10]], out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 30)
        assert o.stats.fallbacks >= 1


@pytest.mark.parametrize("layout,block", [("tiny", 4), ("production", 16)])
def test_drafter_failure_under_sampling_still_completes(request, layout, block):
    models = layout_models(request, layout)
    eng = make_engine(models, Mode.ASYNC, block=block)
    _break_after(eng, calls=3, how="raise")
    out = generate(eng, [PROMPT], SamplingParams(temperature=1.0, seed=3, max_new_tokens=25))[0]
    assert out.error is None and len(out.token_ids) == 25


@pytest.mark.parametrize("layout,block", [("tiny", 4), ("production", 16)])
def test_drafter_recovers_after_a_transient_fault(request, layout, block):
    models = layout_models(request, layout)
    eng = make_engine(models, Mode.ASYNC, block=block)
    runner = eng.drafting.runner
    real, state = runner.run, {"n": 0}

    def flaky(rows):
        state["n"] += 1
        if state["n"] == 3:
            raise RuntimeError("transient")
        return real(rows)

    runner.run = flaky
    out = generate(eng, [PROMPT], SamplingParams(max_new_tokens=30))[0]
    assert out.token_ids == reference_greedy(models[0], PROMPT, 30)
    assert out.stats.fallbacks == 1
    assert state["n"] > 6  # the drafter was used again after the fault


@pytest.mark.parametrize("layout,mode", mode_layouts(["tiny", "production"]))
def test_prompt_near_the_context_limit(request, layout, mode):
    block = {"tiny": 7, "production": 16}[layout]
    models = layout_models(request, layout)
    eng = make_engine(models, mode, block=block, context=64)
    prompt = (list(range(3, 90)) * 2)[:54]
    out = generate(eng, [prompt], SamplingParams(max_new_tokens=10))[0]
    assert out.token_ids == reference_greedy(models[0], prompt, 10)
    with pytest.raises(RequestTooLongError, match="exceeds the context length 64"):
        generate(eng, [prompt + [3]], SamplingParams(max_new_tokens=10))


@pytest.mark.parametrize("bad", [[], [-1, 5], [5, 96]])
def test_bad_prompts_are_refused(tiny_models, bad):
    eng = make_engine(tiny_models, Mode.ASYNC)
    with pytest.raises(ValueError):
        generate(eng, [bad], SamplingParams(max_new_tokens=4))
    assert not eng.has_work()


@pytest.mark.parametrize("layout,block", [("tiny", 4), ("production", 16)])
def test_one_failing_request_does_not_stop_the_others(request, layout, block, monkeypatch):
    models = layout_models(request, layout)
    eng = make_engine(models, Mode.ASYNC, block=block)
    import sglang_d3d.engine.engine as engine_mod

    real = engine_mod.verify_draft

    def picky(*args):
        if picky.fail_next:
            picky.fail_next = False
            raise RuntimeError("boom")
        return real(*args)

    picky.fail_next = True
    monkeypatch.setattr(engine_mod, "verify_draft", picky)
    outs = generate(eng, [PROMPT, [9, 10]], SamplingParams(max_new_tokens=12))
    assert [o.finish_reason for o in outs].count("error") == 1
    ok = next(o for o, p in zip(outs, [PROMPT, [9, 10]]) if o.finish_reason != "error")
    assert len(ok.token_ids) == 12
    assert not eng.has_work() and len(eng.scheduler.free_slots) == 4


def test_failing_prefill_fails_only_its_request(tiny_models, monkeypatch):
    eng = make_engine(tiny_models, Mode.ASYNC)
    real = eng.target.prefill_chunks

    def prefill_chunks(chunks):  # a packed pass holding the bad prompt fails as a whole
        if any(ids == [66, 67] for _, _, ids in chunks):
            raise RuntimeError("bad request")
        return real(chunks)

    monkeypatch.setattr(eng.target, "prefill_chunks", prefill_chunks)
    outs = generate(eng, [PROMPT, [66, 67], [9, 10]], SamplingParams(max_new_tokens=10))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "bad request" in outs[1].error
    assert outs[2].token_ids == reference_greedy(tiny_models[0], [9, 10], 10)


@pytest.mark.parametrize("mode", [Mode.AR, Mode.ASYNC])
def test_failing_metrics_listeners_cost_no_request(request, mode):
    """A cycle or plan listener that raises (a metrics backend gone wrong) is skipped: the
    requests complete, identical to the target's, and the other listeners still hear."""
    models = layout_models(request, "tiny")
    eng = make_engine(models, mode, adaptive=True)

    def boom(*args):
        raise RuntimeError("metrics backend down")

    heard = []
    eng.cycle_listeners.extend([boom, lambda rid, c: heard.append(rid)])
    eng.plan_listeners.append(boom)
    out = generate(eng, [PROMPT, [9, 10]], SamplingParams(max_new_tokens=20))
    for prompt, o in zip([PROMPT, [9, 10]], out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 20)
    assert heard and eng.cycle_listeners.failures[id(boom)] == len(heard)
