"""`d3d bench`: ar, sync, async and fused side by side in one process, on the same prompts.

Modes are interleaved prompt by prompt, each prompt starting with the next mode in turn
(interleave.py), so that machine noise hits them alike; greedy outputs
must be identical across modes (checked, reported, and a non-zero exit if not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.calibrate import CalibrationConfig, calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.interleave import rotated
from sglang_d3d.prompts import chat_ids, load_questions


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, modes=True)
    p.set_defaults(calibrate=True)  # adaptive modes start calibrated, as the server's does
    p.add_argument("--dataset", default="gsm8k", help="gsm8k | mt_bench | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--modes", default="ar,sync,async",
                   help="comma-separated: ar, sync, async, fused; an '@B' suffix sets the block "
                   "size of that mode (fused@4); a '-adaptive' suffix (sync-adaptive, "
                   "async-adaptive) runs that mode under the adaptive controller, which falls "
                   "back to plain decoding where speculation measures slower; '-int8' or "
                   "'-full' (sync-full@8) sets the drafter's weights for that mode; '-cut<X>' "
                   "(sync-cut0.1@8) sets that mode's --draft-cutoff (cut0: whole blocks)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=None, help="save the results as JSON here")
    p.add_argument("--timeline", default=None, help="save the async per-cycle timeline here")


def run_bench(args: argparse.Namespace) -> int:
    modes = args.modes.split(",")
    cfgs = {m: mode_config(args, m) for m in modes}
    target, drafter, tok = load_models(cfgs[modes[-1]])
    engines = {m: SpecEngine(c, target, drafter if c.mode is not Mode.AR else None)
               for m, c in cfgs.items()}
    prompts = [chat_ids(tok, q) for q in load_questions(args.dataset, args.num_prompts)]
    params = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        stop_token_ids=(tok.eos_token_id,), seed=0,
    )
    _warmup(engines, prompts[0], params)
    calibration = _calibrate(engines)
    runs = {m: [] for m in modes}
    for i, ids in enumerate(prompts):
        for m in rotated(modes, i):
            runs[m].append(_timed(engines[m], ids, params))
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{m} {r[-1]['tokens'] / r[-1]['seconds']:.1f} tok/s" for m, r in runs.items()))
    report = _report(args, runs, params.greedy) | {"calibration": calibration}
    _print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.timeline and "async" in engines:
        Path(args.timeline).write_text(json.dumps(engines["async"].timeline.to_list()) + "\n")
    return 0 if report["greedy_identical"] in (True, None) else 1


def mode_config(args: argparse.Namespace, name: str):
    """'async' -> the engine config for async; 'async-adaptive' -> the same with the adaptive
    controller on (whatever --adaptive says for the plain names); '-int8' / '-full' set the
    drafter's weights (whatever --draft-weights says); '-cut<X>' sets the draft cutoff
    (whatever --draft-cutoff says; 'cut0': whole blocks); an '@B' suffix ('fused@4',
    'sync-adaptive@8') sets that mode's block size, so modes can run side by side each at
    its own best block or weights."""
    name, _, block = name.partition("@")
    base, *suffixes = name.split("-")
    cuts = [_cutoff(x) for x in suffixes if x.startswith("cut")]
    suffixes = [x for x in suffixes if not x.startswith("cut")]
    if (not set(suffixes) <= {"adaptive", "int8", "full"} or {"int8", "full"} <= set(suffixes)
            or None in cuts or len(cuts) > 1 or (block and not block.isdigit())):
        raise ValueError(f"unknown mode {name!r}: use ar, sync, async, fused, optionally "
                         "with -adaptive, -int8 or -full, -cut<X>, then @<block size>")
    cfg = engine_config(args, Mode(base).value)
    if block:
        cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, block_size=int(block)))
    for weights in {"int8", "full"} & set(suffixes):  # at most one
        cfg = dataclasses.replace(cfg, draft_weights=weights)
    if cuts:
        cfg = dataclasses.replace(cfg, draft_cutoff=cuts[0])
    return dataclasses.replace(cfg, adaptive=True) if "adaptive" in suffixes else cfg


def _cutoff(suffix: str) -> float | None:
    """'cut0.1' -> 0.1; None where the rest is not a number."""
    try:
        return float(suffix.removeprefix("cut"))
    except ValueError:
        return None


def _warmup(engines, ids, params) -> None:
    short = SamplingParams(max_new_tokens=8, stop_token_ids=params.stop_token_ids)
    for e in engines.values():
        generate(e, [ids], short)
        e.timeline.cycles.clear()


def _calibrate(engines: dict) -> dict:
    """Adaptive modes time their plans before the first prompt, as `d3d serve` does at
    start-up; prompts run one at a time here, so batch 1 is all there is to time.
    {mode: {bucket: {plan: seconds}}} for the report."""
    return {m: calibrate(e, CalibrationConfig(max_batch=1))
            for m, e in engines.items() if e.cfg.adaptive and e.cfg.calibrate}


def _timed(engine: SpecEngine, ids: list[int], params: SamplingParams) -> dict:
    t0 = time.perf_counter()
    out = generate(engine, [ids], params)[0]
    dt = time.perf_counter() - t0
    s = out.stats
    return {
        "seconds": dt, "tokens": len(out.token_ids), "token_ids": out.token_ids,
        "cycles": s.num_cycles, "accepted": sum(s.accepted_lengths),
        "hits": s.branch_hits, "misses": s.branch_misses,
        "draft_time": s.draft_time, "verify_time": s.verify_time,
        "cycle_time": s.cycle_time, "overlap_time": s.overlap_time,
        "prefill_time": s.prefill_time, "fallbacks": s.fallbacks,
    }


def _summary(rs: list[dict]) -> dict:
    tot = {k: sum(r[k] for r in rs) for k in rs[0] if k != "token_ids"}
    cycles = max(1, tot["cycles"])
    hits = tot["hits"] + tot["misses"]
    return {
        "tokens_per_s": tot["tokens"] / tot["seconds"],
        "tokens": tot["tokens"], "seconds": tot["seconds"],
        "mean_accepted_length": tot["accepted"] / cycles,
        "branch_hit_rate": tot["hits"] / hits if hits else None,
        "overlap_fraction": tot["overlap_time"] / tot["cycle_time"] if tot["cycle_time"] else 0.0,
        "mean_cycle_ms": 1e3 * tot["cycle_time"] / cycles,
        "mean_draft_ms": 1e3 * tot["draft_time"] / cycles,
        "mean_verify_ms": 1e3 * tot["verify_time"] / cycles,
        "cycle_over_max_draft_verify": tot["cycle_time"] / max(1e-9, max(tot["draft_time"], tot["verify_time"])),
        "mean_prefill_ms": 1e3 * tot["prefill_time"] / len(rs),
        "fallbacks": tot["fallbacks"],
    }


def _report(args, runs: dict, greedy: bool) -> dict:
    modes = {m: _summary(rs) for m, rs in runs.items()}
    base = modes.get("ar", {}).get("tokens_per_s")
    for s in modes.values():
        s["speedup_vs_ar"] = s["tokens_per_s"] / base if base else None
    identical = None
    if greedy and len(runs) > 1:
        outs = [[r["token_ids"] for r in rs] for rs in runs.values()]
        identical = all(o == outs[0] for o in outs[1:])
    return {
        "dataset": args.dataset, "num_prompts": args.num_prompts, "block_size": args.block_size,
        "branch_policy": args.branch_policy, "branch_budget": args.branch_budget,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "drafter": args.drafter or "default", "greedy_identical": identical, "modes": modes,
    }


def _print(report: dict) -> None:
    cols = ["tokens_per_s", "speedup_vs_ar", "mean_accepted_length", "branch_hit_rate",
            "overlap_fraction", "mean_cycle_ms", "mean_draft_ms", "mean_verify_ms",
            "cycle_over_max_draft_verify"]
    print("mode   " + " ".join(f"{c[:14]:>14}" for c in cols))
    for m, s in report["modes"].items():
        vals = [s[c] for c in cols]
        print(f"{m:<6} " + " ".join(f"{v:>14.3f}" if isinstance(v, float) else f"{str(v):>14}" for v in vals))
    for m, table in report.get("calibration", {}).items():
        print(f"{m} calibrated (seconds per cycle by batch and plan): {table}")
    print(f"greedy outputs identical across modes: {report['greedy_identical']}")
