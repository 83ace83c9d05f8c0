"""Start-up calibration of the adaptive controller: time every candidate plan at every batch
bucket on synthetic requests before the first real request arrives.

Without it the controller learns each (batch bucket, plan) pair's cycle time from live
traffic, and a losing plan's warm-up cycles land on real requests: on this 2-core CPU a
speculative cycle at batch 4 costs 4-11 plain steps, which kept the server 2-7% behind plain
decoding at concurrency 4 and 16 (`benchmarks/bench_controller.py`). Calibrating moves that
cost to start-up, where the server still answers /health with "loading" (the warm-up a GPU
server spends capturing CUDA graphs). Only times are taken: acceptance rates on synthetic text
say nothing about real prompts, so the controller still learns those from traffic.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.adaptive import BlockController, bucket
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.speculative.cycle import Plan
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


class _Scripted:
    """Stands in for the engine's controller while calibrating: runs the plan it is told and
    hands the measured times (not the acceptance) to the real controller. The first cycle
    after a switch is not recorded: it carries the switch (the drafter catching up on tokens
    it did not see), which the controller's own re-measurement also pays, not the plan.
    The times reach the controller at the end (`hand_over`)."""

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

    def hand_over(self) -> None:
        """Each plan's fastest recorded cycle becomes the controller's time for it. Noise on
        a CPU only ever adds time, and the errors are not alike: a plan timed too fast is
        chosen, measured every cycle and corrected at once, while one timed too slow is only
        re-measured now and then (measured: a plain step at batch 4 calibrated at 58 ms
        against 38 ms kept a server speculating at a loss for about 40 requests)."""
        for (b, plan), times in self.seen.items():
            self.real.seed_time(b, plan, min(times), len(times))


def calibrate(engine: SpecEngine, cfg: CalibrationConfig = CalibrationConfig()) -> dict:
    """Measure every plan the controller may choose at each power-of-two batch size up to the
    engine's slots. The engine must be idle; it is idle again afterwards. Returns
    {bucket: {plan name: seconds}} of what was recorded, for the log and the benchmarks."""
    real = engine.controller
    if real is None or engine.has_work():
        raise ValueError("calibration needs an idle engine with the adaptive controller")
    script, t0 = _Scripted(real), time.perf_counter()
    torch.set_num_threads(engine.cfg.target_threads)  # this thread runs the target
    engine.controller = script
    served, engine.proposals = engine.proposals, engine.proposals.for_calibration()
    text, engine.shared_text = engine.shared_text, None  # synthetic text is nobody's guess
    try:
        for batch in _buckets(min(engine.cfg.max_batch_size, cfg.max_batch or 1 << 30)):
            plans = real.allowed(engine.cfg.verify_token_budget // batch)
            if len(plans) > 1:  # one candidate needs no measuring
                _measure_bucket(engine, script, batch, plans, cfg)
    finally:
        engine.controller, engine.proposals, engine.shared_text = real, served, text
        engine.timeline = Timeline()  # synthetic cycles are not the served ones
    script.hand_over()
    table = _table(real, script)
    log.info("calibrated the controller in %.1f s: %s", time.perf_counter() - t0, table)
    return table


def _measure_bucket(engine: SpecEngine, script: _Scripted, batch: int, plans: list[Plan],
                    cfg: CalibrationConfig) -> None:
    """Keep `batch` synthetic requests running and give each plan its cycles in turn."""
    ids = itertools.count()
    live: set[str] = set()
    try:
        for plan in plans:
            script.switch(plan)
            for _ in range(cfg.max_steps_per_plan):
                if script.recorded(batch, plan) >= cfg.cycles:
                    break
                _top_up(engine, live, ids, batch, cfg)
                live -= {ev.request_id for ev in engine.step() if ev.finished}
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


def _table(real: BlockController, script: _Scripted) -> dict:
    table: dict[int, dict[str, float]] = {}
    for b, plan in sorted(script.seen):
        table.setdefault(b, {})[plan.name] = round(real.times[(b, plan)], 4)
    return table
