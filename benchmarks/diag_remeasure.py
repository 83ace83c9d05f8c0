"""What a speculative cycle costs at batch 4 in three settings: steady (sync, block 4, no
controller), right after plain decoding (a script of 9 plain cycles then 3 block-4 cycles),
and when the adaptive controller re-measures it between plain cycles (each such cycle
listed with its parts). Prints median milliseconds; for the open question of why
re-measured cycles cost more than steady ones.

    .venv/bin/python benchmarks/diag_remeasure.py --branch-budget 1
"""

from __future__ import annotations

import argparse
import collections
import statistics
from dataclasses import replace

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.calibrate import calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.prompts import chat_ids, load_questions
from sglang_d3d.speculative.cycle import Plan


class Script:
    """A stand-in controller: 9 plain cycles, then 3 of block 4, over and over."""

    def __init__(self) -> None:
        self.n = 0

    def choose(self, batch: int, max_block: int | None = None, evidence=()) -> Plan:
        self.n += 1
        return Plan(4) if self.n % 12 in (0, 1, 2) else Plan(1)

    def observe(self, *args) -> None:
        pass


def run(engine: SpecEngine, prompts: list, batch: int) -> list:
    params = SamplingParams(max_new_tokens=64)
    for i in range(0, len(prompts), batch):
        generate(engine, prompts[i : i + batch], params)
    return [c for c in engine.timeline.cycles if c.batch == batch]


def ms(values) -> str:
    return f"{1e3 * statistics.median(values):.1f} ms" if values else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p, adaptive=True)
    p.add_argument("--num-prompts", type=int, default=16)
    a = p.parse_args()
    if a.num_prompts < 4:
        p.error("--num-prompts must be at least 4")
    target, drafter, tok = load_models(engine_config(a, "async"))
    prompts = [chat_ids(tok, q) for q in load_questions("gsm8k", a.num_prompts)]
    cfg = engine_config(a, "sync")
    cfg = replace(cfg, adaptive=False, spec=replace(cfg.spec, block_size=4))
    steady = run(SpecEngine(cfg, target, drafter), prompts, 4)
    print("steady block 4:", ms([c.end for c in steady if c.block == 4]))
    scripted = SpecEngine(engine_config(a, "async"), target, drafter)
    scripted.controller = Script()
    nth = collections.defaultdict(list)
    prev, run_len = 1, 0
    for c in run(scripted, prompts, 4):
        run_len = run_len + 1 if c.block == 4 and prev == 4 else int(c.block == 4)
        if c.block == 4:
            nth[run_len].append(c.end)
        prev = c.block
    print("after plain decoding, block-4 cycle #1/#2/#3:", [ms(nth[k]) for k in (1, 2, 3)])
    controlled = SpecEngine(engine_config(a, "async"), target, drafter)
    calibrate(controlled)
    for c in run(controlled, prompts, 4):
        if c.block > 1:
            print(f"re-measured block {c.block}: {1e3 * c.end:.0f} ms (draft "
                  f"{1e3 * c.draft_end:.0f}, verify {1e3 * (c.verify_end - c.verify_start):.0f}, "
                  f"pre-draft {1e3 * (c.predraft_end - c.predraft_start):.0f})")


if __name__ == "__main__":
    main()
