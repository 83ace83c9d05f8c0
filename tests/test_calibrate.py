"""Start-up calibration of the adaptive controller (engine/calibrate.py)."""

from __future__ import annotations

import pytest
from conftest import reference_greedy
from engine_helpers import make_engine

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.adaptive import bucket
from sglang_d3d.engine.calibrate import CalibrationConfig, _buckets, calibrate, synthetic_prompt
from sglang_d3d.engine.offline import generate


def test_synthetic_prompt_repeats_ids_inside_the_vocabulary():
    p = synthetic_prompt(100, 20)
    assert len(p) == 20 and all(0 <= t < 100 for t in p)
    assert p[:8] == p[8:16] and len(set(p[:8])) == 8
    assert synthetic_prompt(100, 0) == p[:1]  # never empty


def test_buckets_are_the_powers_of_two_up_to_the_slots():
    assert _buckets(1) == [1] and _buckets(4) == [1, 2, 4] and _buckets(6) == [1, 2, 4]


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_every_allowed_plan_is_timed_at_every_bucket_and_the_engine_is_left_clean(tiny_models, mode):
    hf = tiny_models[0]
    engine = make_engine(tiny_models, mode, block=4, batch=4, adaptive=True, verify_token_budget=8)
    ctl = engine.controller
    table = calibrate(engine, CalibrationConfig(cycles=2, prompt_len=12))
    for b in (1, 2, 4):
        allowed = ctl.allowed(8 // b)
        assert len(allowed) > 1 or b not in table
        for plan in allowed if len(allowed) > 1 else []:
            assert ctl.samples[(b, plan)] >= 2 and ctl.times[(b, plan)] > 0
    assert 4 not in table  # a budget of 8 tokens leaves batch 4 only plain decoding
    assert ctl.accepted == [] and ctl.reached == []  # synthetic text teaches no acceptance
    assert not engine.has_work() and engine.timeline.to_list() == []
    assert engine.controller is ctl and engine.proposals.copy_ngram == engine.cfg.copy_ngram > 0
    # every slot is free again and serving is exact
    prompts = [[5, 6, 7], [9, 3], [4, 4, 8, 1], [2]]
    outs = generate(engine, prompts, SamplingParams(max_new_tokens=10))
    assert [o.token_ids for o in outs] == [reference_greedy(hf, p, 10) for p in prompts]


def test_rows_of_a_bucket_have_staggered_lengths_as_served_rows_do(tiny_models):
    """Equal rows take attention's one-call path, which served rows of different lengths do
    not: calibration's rows differ by `stagger` tokens so its times are the served ones."""
    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=4, adaptive=True)
    lengths = []
    submit = engine.submit
    engine.submit = lambda req: (lengths.append(len(req.prompt_ids)), submit(req))[1]
    calibrate(engine, CalibrationConfig(cycles=2, prompt_len=8, stagger=4))
    assert lengths[0] == 8  # batch 1 first
    rows = [lengths[i : i + 4] for i in range(len(lengths))]
    assert [8, 12] in [r[:2] for r in rows] and [8, 12, 16, 20] in rows  # batches 2 and 4
    assert set(lengths) == {8, 12, 16, 20}  # replacements keep their row's length


def test_a_request_that_ends_early_is_replaced_so_the_bucket_is_still_measured(tiny_models):
    # a context of 24 tokens ends every synthetic request after a few cycles
    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, context=24, adaptive=True)
    calibrate(engine, CalibrationConfig(cycles=3, prompt_len=8))
    for plan in engine.controller.candidates:
        assert engine.controller.samples[(bucket(2), plan)] >= 3
    assert not engine.has_work()


def test_calibration_refuses_an_engine_it_cannot_calibrate(tiny_models):
    with pytest.raises(ValueError, match="adaptive"):
        calibrate(make_engine(tiny_models, Mode.SYNC))  # no controller
    busy = make_engine(tiny_models, Mode.SYNC, adaptive=True)
    busy.submit(GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    with pytest.raises(ValueError, match="idle"):
        calibrate(busy)


def test_a_plan_is_timed_by_its_fastest_cycle_after_the_switch():
    from sglang_d3d.engine.adaptive import BlockController, Plan
    from sglang_d3d.engine.calibrate import _Scripted

    real = BlockController(candidates=(Plan(1), Plan(4)))
    script = _Scripted(real)
    script.switch(Plan(4))
    for seconds in (0.9, 0.5, 0.2, 0.4):  # 0.9: the switching cycle, not recorded
        script.observe(2, Plan(4), seconds, [(3, 3), (3, 3)])
    assert script.recorded(2, Plan(4)) == 3 and real.times == {}  # nothing handed over yet
    # noise only adds time; a plan timed too slow would be re-measured too rarely to recover
    assert script.fastest() == [(2, Plan(4), 0.2, 3)]


def test_the_controller_plans_for_requests_still_prefilling(tiny_models):
    """A request prefilling in chunks decodes from the next cycles on: the plan is chosen for
    the batch with it, not for the one cycle without it."""
    engine = make_engine(tiny_models, Mode.SYNC, adaptive=True, prefill_chunk=4)
    asked = []
    choose = engine.controller.choose
    engine.controller.choose = (lambda batch, max_block=None, evidence=():
                                asked.append((batch, max_block, len(evidence)))
                                or choose(batch, max_block, evidence))
    engine.submit(GenerationRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=12)))
    engine.step()  # prefill a
    engine.step()  # a decodes alone
    engine.submit(GenerationRequest("b", list(range(3, 23)), SamplingParams(max_new_tokens=4)))
    engine.step()  # b's first chunk, then a's cycle: b is joining
    # a's own acceptance counts (b has none yet), and the verify budget is the two rows'
    # (the plans calibrated at their bucket), not a's alone
    budget = engine.cfg.verify_token_budget
    assert asked == [(1, budget, 1), (2, budget // 2, 1)]


def test_each_row_brings_its_own_acceptance_to_the_controller(tiny_models):
    """Every cycle that put drafts to the test adds to the row's own counts, which the
    controller reads with the traffic's rates as their prior (engine/adaptive.py blend)."""
    # lookup_tokens 0: cycles of copies from the text are not the drafter's, and the controller
    # does not count them (test_copy_cycles.py)
    engine = make_engine(tiny_models, Mode.SYNC, block=4, adaptive=True, lookup_tokens=0)
    seen, choose = [], engine.controller.choose
    engine.controller.choose = (lambda batch, max_block=None, evidence=():
                                seen.extend(evidence) or choose(batch, max_block, evidence))
    cycles = []
    engine.cycle_listeners.append(lambda rid, c: cycles.append((c.num_drafts, c.num_accepted)))
    generate(engine, [[5, 6, 7]], SamplingParams(max_new_tokens=20))
    (counts,) = {id(e): e for e in seen}.values()  # one request, one record
    tested = [(g, n) for g, n in cycles if g > 0]
    assert tested and counts.reached[0] == len(tested)
    assert counts.accepted[0] == sum(n > 0 for _, n in tested)


def test_a_stopped_calibration_hands_the_engine_back_and_goes_on_later(tiny_models):
    from sglang_d3d.engine.calibrate import Calibration

    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=4, adaptive=True)
    done = []
    run = Calibration(engine, CalibrationConfig(cycles=2, prompt_len=8), on_done=done.append)
    assert run.todo == [1, 2, 4]
    steps = []
    step = engine.step
    engine.step = lambda: (steps.append(1), step())[1]
    # a request arrives after 3 steps of batch 1: the run stops and the engine is idle
    assert run.run(stop=lambda: len(steps) >= 3) is False
    assert not engine.has_work() and run.todo == [1, 2, 4] and done == []
    served = {k for k in engine.controller.times}
    assert served == set()  # batch 1 was not finished: nothing half-measured is handed over
    assert run.run() is True and run.todo == [] and len(done) == 1
    assert {b for b, *_ in done[0]} == {1, 2, 4} and run.table.keys() == {1, 2, 4}


def test_calibration_stops_at_its_time_limit_and_leaves_the_rest_to_traffic(tiny_models, caplog):
    from sglang_d3d.engine.calibrate import Calibration

    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=4, adaptive=True)
    run = Calibration(engine, CalibrationConfig(cycles=2, prompt_len=8, time_limit_s=0.0))
    with caplog.at_level("INFO"):
        assert run.run() is True  # given up, not pending
    assert engine.controller.times == {} and not engine.has_work()
    assert "stopped at its time limit" in caplog.text


def test_calibration_logs_each_batch_size_as_it_starts(tiny_models, caplog):
    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, adaptive=True)
    with caplog.at_level("INFO"):
        calibrate(engine, CalibrationConfig(cycles=2, prompt_len=8))
    assert "batch 1 (1 of 2 sizes)" in caplog.text and "batch 2 (2 of 2 sizes)" in caplog.text
    assert "calibrated the controller in" in caplog.text


def test_a_measured_calibration_is_reused_at_the_next_start_on_the_same_key(tmp_path):
    from sglang_d3d.config import EngineConfig
    from sglang_d3d.engine import calibration_cache as cc
    from sglang_d3d.engine.adaptive import Plan

    key = cc.cache_key(EngineConfig(), None, None)
    times = [(1, Plan(1), 0.01, 3), (1, Plan(4, True), 0.02, 3)]
    assert cc.load(key, tmp_path) == []
    cc.save(key, times, tmp_path)
    assert cc.load(key, tmp_path) == times
    other = cc.cache_key(EngineConfig(max_batch_size=3), None, None)  # another setting
    assert cc.key_name(other) != cc.key_name(key) and cc.load(other, tmp_path) == []
    assert "cpu" in key and "torch" in key
    (tmp_path / f"{cc.key_name(key)}.json").write_text("{broken")
    assert cc.load(key, tmp_path) == []  # unreadable: measured again


def test_at_the_time_limit_the_plans_finished_serve_but_are_not_kept(tiny_models, monkeypatch):
    """Out of time inside a batch size: the plans that got all their cycles go to the
    controller; none is kept for the cache, so the next start measures that size whole."""
    import sglang_d3d.engine.calibrate as cal
    from sglang_d3d.engine.calibrate import Calibration

    engine = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, adaptive=True)
    from types import SimpleNamespace

    clock = iter(range(10_000))  # calibration's own clock: one second a reading (a step)
    monkeypatch.setattr(cal, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    kept = []
    run = Calibration(engine, CalibrationConfig(cycles=2, prompt_len=8, time_limit_s=7),
                      on_done=kept.append)
    assert run.run() is True and run.todo == []
    served = engine.controller.times
    assert served and all(b == 1 for b, _ in served)  # some of batch 1's plans, timed whole
    assert len(served) < len(run.plans[1]) and kept == [[]]
    assert not engine.has_work()
