"""Synchronous speculation on the 4-bit target with the drafter on the target's C++ layer loop
(models/exact_drafter.py, what an int8 runner takes for passes of up to 16 inputs) against the
same engine whose drafter runs every pass on its int8 copy, beside plain decoding (`ar`).

Per dataset, each prompt runs through every engine in turn (one engine each, so that one's
finished answers are never another's copies), 1 intra-op thread. Tokens per second of process
CPU time, not wall time: on a machine shared with other jobs, CPU time counts what each engine
computes and not the time it waits for a core (it still meets their load on the memory bus).

    .venv/bin/python benchmarks/bench_draft_paths.py --json runs/draft_paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import eos_token_ids, load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.prompts import chat_ids, load_questions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

ENGINES = ("ar", "sync, C++ loop", "sync, int8 copy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="gsm8k,mbpp,mt_bench")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    target, drafter, tok = load_models(EngineConfig(mode=Mode.SYNC, target_weights="auto"))
    if not drafter.on_exact_loop():
        raise SystemExit("the target does not run on the 4-bit C++ loop here (no compiler, or not the default target)")
    eos = eos_token_ids(target, tok)
    report = {**run_info(weights="q4_1"), "args": vars(a), "datasets": {}}
    for ds in a.datasets.split(","):
        engines = _engines(target, drafter, eos, a.block)
        rows = _run(engines, [chat_ids(tok, q) for q in load_questions(ds, a.num_prompts)], a, eos)
        report["datasets"][ds] = rows
        for name, r in rows.items():
            print(f"{ds} | {name} | {r['tokens_per_cpu_s']} tok/CPU-s | {r['over_ar']}x ar | accepted "
                  f"{r['accepted_length']} | outputs = ar {r['same_as_ar']}/{a.num_prompts}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")


def _engines(target, drafter, eos, block: int) -> dict:
    out = {}
    for name in ENGINES:
        mode = Mode.AR if name == "ar" else Mode.SYNC
        cfg = EngineConfig(mode=mode, target_threads=1, draft_threads=1, adaptive=False, max_batch_size=1,
                           max_context=1024, spec=SpecConfig(block_size=block))
        eng = SpecEngine(cfg, target, None if mode is Mode.AR else drafter, eos)
        if name.endswith("int8 copy"):
            eng.drafting.runner.exact_rows = 0  # every pass on the int8 copy
        out[name] = eng
    return out


def _run(engines: dict, prompts: list[list[int]], a, eos) -> dict:
    warm = [7, 8, 9, 10, 11, 12]  # text no prompt shares
    for eng in engines.values():
        generate(eng, [warm], SamplingParams(max_new_tokens=8, stop_token_ids=eos))
    got = {n: {"tokens": 0, "cpu_s": 0.0, "ids": [], "accepted": []} for n in engines}
    for ids in prompts:
        for name, eng in engines.items():
            t0 = time.process_time()
            out = generate(eng, [ids], SamplingParams(max_new_tokens=a.max_new_tokens, stop_token_ids=eos))[0]
            g = got[name]
            g["cpu_s"] += time.process_time() - t0
            g["tokens"] += len(out.token_ids)
            g["ids"].append(out.token_ids)
            g["accepted"] += list(out.stats.accepted_lengths) if name != "ar" else []
    ar = got["ar"]["tokens"] / got["ar"]["cpu_s"]
    rows = {}
    for name, g in got.items():
        rate = g["tokens"] / g["cpu_s"]
        rows[name] = {"tokens_per_cpu_s": round(rate, 1), "over_ar": round(rate / ar, 2),
                      "accepted_length": round(statistics.mean(g["accepted"]), 2) if g["accepted"] else None,
                      "same_as_ar": sum(x == y for x, y in zip(g["ids"], got["ar"]["ids"])),
                      "tokens": g["tokens"], "cpu_s": round(g["cpu_s"], 2)}
    return rows


if __name__ == "__main__":
    main()
