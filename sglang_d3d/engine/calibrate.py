"""Start-up calibration of the adaptive controller: time every candidate plan at every batch
bucket on synthetic requests before the first real request arrives.

Without it the controller learns each (batch bucket, plan) pair's cycle time from live
traffic, and a losing plan's warm-up cycles land on real requests: on this 2-core CPU a
speculative cycle at batch 4 costs 4-11 plain steps, which kept the server 2-7% behind plain
decoding at concurrency 4 and 16 (`benchmarks/bench_controller.py`). Calibrating moves that
cost to idle time. Only times are taken: acceptance rates on synthetic text say nothing about
real prompts, so the controller still learns those from traffic.

Bounded and visible: each batch size logs a line as it starts, and the whole run stops at
`time_limit_s` (the sizes left are learnt from traffic, as without calibration). `d3d serve`
does not wait for it: the server is ready as soon as the models load, and calibrates while
idle, handing the engine back between two steps when a request arrives (engine/loop.py); each
batch size's times reach the controller as soon as that size is measured. What a run measured
is kept (engine/calibration_cache.py) and reused at the next start on the same CPU, weights and
settings.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.adaptive import BlockController, bucket
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.speculative.cycle import Plan
from sglang_d3d.speculative.listeners import Listeners
from sglang_d3d.speculative.timeline import Timeline

log = logging.getLogger(__name__)

PERIOD = 8  # the synthetic prompt repeats this many tokens; both models learn to copy it


@dataclass(frozen=True)
class CalibrationConfig:
    cycles: int = 3  # recorded cycles per (bucket, plan), after one discarded switching cycle
    max_batch: int | None = None  # the largest batch to time; None: the engine's slots
    prompt_len: int = 64  # the shortest synthetic prompt; the others are staggered (below)
    # Each row's prompt is this many tokens longer than the previous row's. Served rows have
    # different lengths, and attention over rows of different lengths runs row by row
    # (decoder._cached_attention). Equal rows take the one-call path: at batch 16 that timed
    # a plain cycle at 52 ms and block 4 at 230 ms against 83 and 347 ms served, and a
    # speculative plan's estimate stays its calibrated one until it is re-measured. Staggered:
    # 86 and 300 ms.
    stagger: int = 16
    max_steps_per_plan: int = 64  # a bucket whose cycles cannot be had gives up, not hangs
    # The whole run, over every start-up and idle spell; past it the sizes left are learnt from
    # traffic. A 2-core CPU under load took about 9 minutes for batch 1 to 32 in one go, and
    # another, at a load of 8, did not finish batch 1's plans in 120 s.
    time_limit_s: float = 300.0


class _Scripted:
    """Stands in for the engine's controller while calibrating: runs the plan it is told and
    hands the measured times (not the acceptance) to the real controller. The first cycle
    after a switch is not recorded: it carries the switch (the drafter catching up on tokens
    it did not see), which the controller's own re-measurement also pays, not the plan.
    The times reach the controller when the batch size is done (`Calibration._hand_over`)."""

    def __init__(self, real: BlockController) -> None:
        self.real, self.plan, self.skip = real, Plan(1), 0
        self.seen: defaultdict[tuple[int, Plan], list[float]] = defaultdict(list)

    def switch(self, plan: Plan) -> None:
        self.plan, self.skip = plan, 1

    def choose(self, batch: int, max_block: int | None = None, evidence=()) -> Plan:
        return self.plan

    def observe(self, batch: int, plan: Plan, seconds: float, per_row) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.seen[(bucket(batch), plan)].append(seconds)

    def observe_trees(self, plan: Plan, pairs) -> None:
        """What trees yield on synthetic text says nothing about real prompts: dropped."""

    def recorded(self, batch: int, plan: Plan) -> int:
        return len(self.seen.get((batch, plan), ()))

    def fastest(self) -> list[tuple[int, Plan, float, int]]:
        """(bucket, plan, its fastest recorded cycle, cycles recorded), by plan name."""
        return [(b, plan, min(times), len(times))
                for (b, plan), times in sorted(self.seen.items(), key=lambda kv: kv[0][1].name)]


def calibrate(engine: SpecEngine, cfg: CalibrationConfig = CalibrationConfig()) -> dict:
    """Measure every plan the controller may choose at each power-of-two batch size up to the
    engine's slots, in one go (or until `cfg.time_limit_s`). The engine must be idle; it is
    idle again afterwards. Returns {bucket: {plan name: seconds}} of what was recorded, for the
    log and the benchmarks."""
    run = Calibration(engine, cfg)
    run.run()
    return run.table


class Calibration:
    """A calibration that may pause: `run(stop)` hands the engine back between two steps once
    `stop()` is true, and a later `run` goes on with the batch sizes not yet measured (the one
    it stopped in starts again). Times already known to the controller (from the cache, or
    measured on traffic while paused) are not overwritten."""

    def __init__(self, engine: SpecEngine, cfg: CalibrationConfig = CalibrationConfig(),
                 known: tuple[int, ...] = (),
                 on_done: Callable[[list[tuple[int, Plan, float, int]]], object] | None = None,
                 ) -> None:
        real = engine.controller
        if real is None:
            raise ValueError("calibration needs the adaptive controller")
        # while a run has the engine, engine.controller is the run's script: readers on other
        # threads (the metrics) ask for this one (EngineLoop.controller)
        self.real = real
        self.shared_text = engine.shared_text  # the served index, kept off the engine in a run
        self.engine, self.cfg, self.spent = engine, cfg, 0.0
        sizes = _buckets(min(engine.cfg.max_batch_size, cfg.max_batch or 1 << 30))
        plans = {b: real.allowed(engine.cfg.verify_token_budget // b) for b in sizes}
        # one candidate needs no measuring; sizes in `known` came from the cache
        self.todo = [b for b in sizes if len(plans[b]) > 1 and b not in known]
        self.plans, self.total = plans, len(self.todo)
        self.times: list[tuple[int, Plan, float, int]] = []  # what this run measured
        self.on_done = on_done  # called once with `times` when nothing is left
        self.table: dict[int, dict[str, float]] = {}

    @property
    def done(self) -> bool:
        return not self.todo

    def run(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Measure the sizes left until all are done (True), `stop()` (False) or the time
        limit (True: the rest is given up and learnt from traffic)."""
        engine, real = self.engine, self.engine.controller
        if engine.has_work():
            raise ValueError("calibration needs an idle engine")
        t0 = time.perf_counter()
        out_of_time = lambda: self.spent + time.perf_counter() - t0 > self.cfg.time_limit_s  # noqa: E731
        torch.set_num_threads(engine.cfg.target_threads)  # this thread runs the target
        served, engine.proposals = engine.proposals, engine.proposals.for_calibration()
        text, engine.shared_text = engine.shared_text, None  # synthetic text is nobody's guess
        # synthetic cycles are not served ones: the metrics' listeners do not hear them
        listeners = engine.cycle_listeners, engine.plan_listeners
        engine.cycle_listeners, engine.plan_listeners = Listeners(), Listeners()
        try:
            while self.todo and not stop() and not out_of_time():
                batch = self.todo[0]
                log.info("calibrating the controller: batch %d (%d of %d sizes), %.0f s so far "
                         "of at most %.0f s", batch, self.total - len(self.todo) + 1, self.total,
                         self.spent + time.perf_counter() - t0, self.cfg.time_limit_s)
                script = _Scripted(real)
                engine.controller = script
                try:
                    measured = _measure_bucket(engine, script, batch, self.plans[batch], self.cfg,
                                               lambda: stop() or out_of_time())
                finally:
                    engine.controller = real
                if not measured:
                    if out_of_time():  # the plans it finished serve now; not kept, so the
                        # next start measures this size whole
                        self._hand_over(script, real, min_cycles=self.cfg.cycles, keep=False)
                    break
                self._hand_over(script, real)
                self.todo.pop(0)
        finally:
            engine.proposals, engine.shared_text = served, text
            engine.cycle_listeners, engine.plan_listeners = listeners
            engine.timeline = Timeline()  # synthetic cycles are not the served ones
            self.spent += time.perf_counter() - t0
        if self.todo and self.spent > self.cfg.time_limit_s:
            log.warning("calibration stopped at its time limit (%.0f s): the plans of batch "
                        "sizes %s not yet timed are learnt from traffic (measured: %s)",
                        self.cfg.time_limit_s, self.todo, self.table)
            self.todo = []
        elif not self.todo:
            log.info("calibrated the controller in %.1f s: %s", self.spent, self.table)
        if self.done and self.on_done is not None:
            self.on_done(self.times)
            self.on_done = None
        return self.done

    def _hand_over(self, script: _Scripted, real: BlockController, min_cycles: int = 1,
                   keep: bool = True) -> None:
        """Each plan's fastest recorded cycle becomes the controller's time for it, unless
        traffic has measured it already. Noise on a CPU only ever adds time, and the errors are
        not alike: a plan timed too fast is chosen, measured every cycle and corrected at once,
        while one timed too slow is only re-measured now and then (measured: a plain step at
        batch 4 calibrated at 58 ms against 38 ms kept a server speculating at a loss for about
        40 requests)."""
        for b, plan, seconds, samples in script.fastest():
            if samples < min_cycles:
                continue
            if keep:  # what `on_done` hands to the cache
                self.times.append((b, plan, seconds, samples))
            if (b, plan) not in real.times:
                real.seed_time(b, plan, seconds, samples)
            self.table.setdefault(b, {})[plan.name] = round(real.times[(b, plan)], 4)


def _measure_bucket(engine: SpecEngine, script: _Scripted, batch: int, plans: list[Plan],
                    cfg: CalibrationConfig, stop: Callable[[], bool] = lambda: False) -> bool:
    """Keep `batch` synthetic requests running and give each plan its cycles in turn. False if
    `stop()` came first; the engine is idle again either way."""
    ids = itertools.count()
    live: set[str] = set()
    try:
        for plan in plans:
            script.switch(plan)
            for _ in range(cfg.max_steps_per_plan):
                if script.recorded(batch, plan) >= cfg.cycles:
                    break
                if stop():
                    return False
                _top_up(engine, live, ids, batch, cfg)
                live -= {ev.request_id for ev in engine.step() if ev.finished}
        return True
    finally:
        for rid in live:
            engine.abort(rid)
        while engine.has_work():
            engine.step()


def _top_up(engine: SpecEngine, live: set[str], ids, batch: int, cfg: CalibrationConfig) -> None:
    """Requests that ended (length or end-of-sequence) are replaced, so the batch holds; the
    n-th request's prompt has prompt_len + stagger * (n mod batch) tokens."""
    vocab, room = engine.vocab_size, engine.cfg.max_context
    while len(live) < batch:
        n = next(ids)
        prompt = synthetic_prompt(vocab, min(cfg.prompt_len + cfg.stagger * (n % batch), room // 2))
        params = SamplingParams(max_new_tokens=max(1, room - len(prompt)))
        rid = f"calibrate-{n}"
        engine.submit(GenerationRequest(rid, prompt, params))
        live.add(rid)


def synthetic_prompt(vocab_size: int, length: int) -> list[int]:
    """A repeated run of PERIOD ids from the middle of the vocabulary (clear of the special
    tokens at its start): both models continue it, so drafts are accepted as on easy text."""
    period = [(vocab_size // 2 + 7 * i) % vocab_size for i in range(PERIOD)]
    return [period[i % PERIOD] for i in range(max(1, length))]


def _buckets(max_batch: int) -> list[int]:
    return [1 << k for k in range(max(1, max_batch).bit_length()) if 1 << k <= max_batch]
