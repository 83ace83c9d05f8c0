"""Run an engine to completion in the calling thread (CLI, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang_d3d.api import GenerationRequest, TokenEvent
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.speculative.stats import RequestStats


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None


def generate(
    engine: SpecEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    on_finish: Callable[[int], None] | None = None,  # on_finish(i): prompt i's output is done
) -> list[Output]:
    """Submit every prompt, step until all finish. Outputs are in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    torch.set_num_threads(engine.cfg.target_threads)  # this thread runs the target
    outs = [Output() for _ in prompts]

    def collect(i: int):
        def on_event(ev: TokenEvent) -> None:
            outs[i].token_ids.extend(ev.token_ids)
            if ev.finished:
                outs[i].finish_reason, outs[i].error, outs[i].stats = (
                    ev.finish_reason, ev.error, ev.stats,
                )
                if on_finish is not None:
                    on_finish(i)
        return on_event

    callbacks = {}
    for i, (ids, p) in enumerate(zip(prompts, plist)):
        rid = f"offline-{id(outs)}-{i}"
        callbacks[rid] = collect(i)
        engine.submit(GenerationRequest(rid, list(ids), p))
    while engine.has_work():
        for ev in engine.step():
            callbacks[ev.request_id](ev)
    return outs
