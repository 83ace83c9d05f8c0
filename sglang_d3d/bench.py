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
from collections import Counter
from pathlib import Path

from sglang_d3d.cli_args import add_engine_args, add_request_args, engine_config, request_fields
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.calibrate import CalibrationConfig, calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_drafter, load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.interleave import rotated
from sglang_d3d.models.loading import resolve_drafter_path
from sglang_d3d.prompts import chat_ids, load_questions
from sglang_d3d.speculative.grammar import tokenizer_grammars
from sglang_d3d.speculative.stats import kind_summary
from sglang_d3d.training.datagen_async import template_kwargs


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, modes=True)
    p.set_defaults(calibrate=True)  # adaptive modes start calibrated, as the server's does
    p.add_argument("--dataset", default="gsm8k",
                   help="gsm8k | mt_bench | mbpp (code, bundled) | FILE.jsonl in any shape "
                   "`d3d datagen --prompts` reads (ShareGPT `conversations`, OpenAI `messages`, "
                   "`turns`, `prompt`): each conversation's first user turn")
    p.add_argument("--num-prompts", type=int, default=20, help="the first N prompts of the set")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object for the target's chat template, as in `d3d datagen`: "
                   "'{\"enable_thinking\": false}' asks Qwen3 with thinking off")
    p.add_argument("--modes", type=mode_list, default="ar,sync,async",
                   help="comma-separated: ar, sync, async, fused; an '@B' suffix sets the block "
                   "size of that mode (fused@4); a '-adaptive' suffix (sync-adaptive, "
                   "async-adaptive) runs that mode under the adaptive controller, which falls "
                   "back to plain decoding where speculation measures slower; '-int8' or "
                   "'-full' (sync-full@8) sets the drafter's weights for that mode; '-cut<X>' "
                   "(sync-cut0.1@8) sets that mode's --draft-cutoff (cut0: whole blocks); '-tree<N>' "
                   "(sync-tree7@5) its --tree-nodes (tree0: chains); '-lookup<N>' (sync-lookup0) "
                   "its --lookup-tokens; '-copy<N>' (sync-copy0) its --copy-ngram; '-shared<N>' "
                   "(async-shared0) its --shared-lookup-tokens; '-corpus<N>' its --corpus-tokens; "
                   "'-guesses<N>' (async-guesses0) its --copy-guesses; '-bits<N>' (sync-bits14) "
                   "its --draft-input-bits; '-alt' runs that mode "
                   "with --alt-drafter in place of --drafter")
    p.add_argument("--alt-drafter", default=None,
                   help="a second drafter folder for the '-alt' modes, so that two drafters "
                   "(their weights and corpora) run side by side on one target in one run")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    add_request_args(p)
    p.add_argument("--out", default=None, help="save the results as JSON here")
    p.add_argument("--timeline", default=None, help="save the async per-cycle timeline here")


def run_bench(args: argparse.Namespace) -> int:
    modes = args.modes
    alt = check_alt(args, modes)
    if alt:  # a wrong folder fails before any model loads
        resolve_drafter_path(args.alt_drafter)
    cfgs = {m: mode_config(args, m) for m in modes}
    questions = load_questions(args.dataset, args.num_prompts)  # a bad --dataset fails before loading
    template = template_kwargs(args.chat_template_kwargs)  # so does a bad --chat-template-kwargs
    # the drafter loads where any mode drafts, not only where the last one does
    drafting = [m for m in modes if cfgs[m].mode is not Mode.AR]
    target, drafter, tok = load_models(cfgs[drafting[-1] if drafting else modes[-1]])
    if alt:  # the '-alt' modes' drafter, on the same target
        alt_drafter = load_drafter(args.alt_drafter, target, cfgs[alt[0]])
    eos = (tok.eos_token_id,)
    rules = request_fields(args)
    grammars = tokenizer_grammars(tok, target.arch.vocab_size, eos) if rules["grammar"] else None
    engines = {m: SpecEngine(c, target, None if c.mode is Mode.AR
                             else alt_drafter if m in alt else drafter, (), grammars)
               for m, c in cfgs.items()}
    prompts = [chat_ids(tok, q, template) for q in questions]
    params = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        stop_token_ids=eos, seed=0, **rules,
    )
    _warmup(engines, prompts[0], params)
    calibration = _calibrate(engines)
    runs = {m: [] for m in modes}
    for i, ids in enumerate(prompts):
        for m in rotated(modes, i):
            runs[m].append(_timed(engines[m], ids, params))
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{m} {r[-1]['tokens'] / r[-1]['seconds']:.1f} tok/s" for m, r in runs.items()))
    report = _run_fields(args) | _report(args, runs, params.greedy) | {
        "calibration": calibration, "prompts_run": len(prompts)}
    _print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.timeline and "async" in engines:
        Path(args.timeline).write_text(json.dumps(engines["async"].timeline.to_list()) + "\n")
    return 0 if report["greedy_identical"] in (True, None) else 1


# '-<prefix><N>' mode suffixes that set an integer engine setting for that mode
COUNT_SUFFIXES = {"tree": "tree_nodes", "lookup": "lookup_tokens", "copy": "copy_ngram",
                  "shared": "shared_lookup_tokens", "corpus": "corpus_tokens",
                  "guesses": "copy_guesses", "bits": "draft_input_bits"}


@dataclasses.dataclass(frozen=True)
class ModeName:
    """One `--modes` entry, parsed: 'async-adaptive-cut0.05@8'."""

    name: str
    base: Mode
    adaptive: bool = False
    weights: str | None = None  # 'int8' | 'full' | None (whatever --draft-weights says)
    cutoff: float | None = None  # None: whatever --draft-cutoff says
    counts: tuple[tuple[str, int], ...] = ()  # (EngineConfig field, value) from COUNT_SUFFIXES
    block: int | None = None  # None: whatever --block-size says
    alt: bool = False  # True: --alt-drafter in place of --drafter


def parse_mode(name: str) -> ModeName:
    """'async' -> async; '-adaptive' turns the adaptive controller on (whatever --adaptive
    says for the plain names); '-int8' / '-full' set the drafter's weights; '-cut<X>' sets
    the draft cutoff ('cut0': whole blocks); '-tree<N>' the tree size ('tree0': chains),
    '-lookup<N>' the copied guesses per tree, '-copy<N>' the match that lets a cycle verify
    copies without drafting ('copy0': never), '-shared<N>' the finished requests' tokens
    greedy rows copy from ('shared0': none), '-corpus<N>' the tokens of the drafter's corpus
    they copy from ('corpus0': none), '-guesses<N>' the other texts' guesses a cycle of copies
    verifies beside them ('guesses0': copies alone), '-bits<N>' the bits the drafter's passes
    keep of their inputs on a 4-bit target ('bits14': the target's rounding); '-alt' runs it with --alt-drafter; an '@B' suffix ('fused@4', 'sync-adaptive@8')
    sets the block size, so modes run side by side each at its own best block or weights.
    Raises ValueError naming the accepted forms."""
    stem, _, block = name.partition("@")
    base, *suffixes = stem.split("-")
    cuts = [_cutoff(x) for x in suffixes if x.startswith("cut")]
    counts = [(field, x.removeprefix(prefix)) for x in suffixes
              for prefix, field in COUNT_SUFFIXES.items() if x.startswith(prefix)]
    rest = [x for x in suffixes if not x.startswith(("cut", *COUNT_SUFFIXES))]
    weights = [x for x in rest if x in ("int8", "full")]
    fields = [f for f, _ in counts]
    if (base not in {m.value for m in Mode} or not set(rest) <= {"adaptive", "int8", "full", "alt"}
            or len(weights) > 1 or None in cuts or len(cuts) > 1
            or len(set(fields)) < len(fields) or not all(v.isdigit() for _, v in counts)
            or (block and not (block.isdigit() and int(block) >= 1))):
        raise ValueError(f"unknown mode {name!r}: use ar, sync, async or fused, optionally "
                         "with -adaptive, -int8 or -full, -alt, -cut<X>, -tree<N>, -lookup<N>, "
                         "-copy<N>, -shared<N>, -corpus<N>, -guesses<N>, -bits<N>, "
                         "then @<block size>")
    if cuts and not 0.0 <= cuts[0] < 1.0:
        raise ValueError(f"mode {name!r}: the draft cutoff must be in [0, 1)")
    return ModeName(name, Mode(base), "adaptive" in rest, (weights or [None])[0],
                    cuts[0] if cuts else None, tuple((f, int(v)) for f, v in counts),
                    int(block) if block else None, "alt" in rest)


def mode_list(text: str) -> list[str]:
    """The `--modes` argparse type: a misspelt mode is a usage error, not a traceback after
    the models have loaded."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    try:
        for m in names:
            parse_mode(m)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not names:
        raise argparse.ArgumentTypeError("no modes given")
    twice = sorted(m for m, n in Counter(names).items() if n > 1)
    if twice:  # one engine and one result per name: a repeat would be timed twice as one
        raise argparse.ArgumentTypeError(f"mode {twice[0]!r} is given more than once")
    return names


def mode_config(args: argparse.Namespace, name: str):
    """The engine config for one `--modes` entry (`parse_mode`)."""
    m = parse_mode(name)
    cfg = engine_config(args, m.base.value)
    if m.block is not None:
        cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, block_size=m.block),
                                  fixed_block=m.block)
    if m.weights is not None:
        cfg = dataclasses.replace(cfg, draft_weights=m.weights)
    if m.cutoff is not None:
        cfg = dataclasses.replace(cfg, draft_cutoff=m.cutoff)
    if m.counts:
        cfg = dataclasses.replace(cfg, **dict(m.counts))
    return dataclasses.replace(cfg, adaptive=True) if m.adaptive else cfg


def check_alt(args: argparse.Namespace, modes: list[str]) -> list[str]:
    """The '-alt' modes. They need --alt-drafter, and --alt-drafter needs a mode that uses
    it."""
    alt = [m for m in modes if parse_mode(m).alt]
    if alt and args.alt_drafter is None:
        raise ValueError(f"modes {', '.join(alt)} run with --alt-drafter: give its folder")
    if args.alt_drafter is not None and not alt:
        raise ValueError("--alt-drafter is given but no mode runs with it: add '-alt' to one "
                         "(async-adaptive-alt@8)")
    return alt


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
        if e.shared_text is not None:  # the first prompt's own answer is not traffic before it
            e.shared_text.clear()


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
        "prefill_time": s.prefill_time, "fallbacks": s.fallbacks, "copy_cycles": s.copy_cycles,
        **{k: getattr(s, k) for k in KIND_TALLIES},
    }


KIND_TALLIES = ("kind_cycles", "kind_tokens", "kind_seconds")  # RequestStats, by cycle kind


def _summary(rs: list[dict]) -> dict:
    tot = {k: sum(r[k] for r in rs) for k in rs[0] if k != "token_ids" and k not in KIND_TALLIES}
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
        # cycles that verified runs copied from the text, with no drafter pass (lookup.py)
        "copy_cycle_fraction": tot["copy_cycles"] / cycles,
        # where the decoding time went, by cycle kind (plain / copy / draft)
        "by_kind": kind_summary(*(_merged([r[k] for r in rs]) for k in KIND_TALLIES)),
    }


def _merged(tallies: list[dict]) -> dict:
    """Sum per-request {kind: count} tallies."""
    out: Counter = Counter()
    for t in tallies:
        out.update(t)  # adds values, keeping floats
    return dict(out)


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
        **_recorded(request_fields(args)),
        "drafter": args.drafter or "default", "alt_drafter": args.alt_drafter,
        "greedy_identical": identical, "modes": modes,
    }


def _run_fields(args) -> dict:
    """cpu, weights, commit and command, as every results JSON records them: through
    benchmarks/run_info.py in a clone, else the CPU and weights with an unknown commit."""
    import importlib.util
    import sys

    from sglang_d3d.engine.calibration_cache import cpu_name

    weights = f"target {_resolved_weights(args)} (--target-weights {args.target_weights})"
    argv = ["d3d", *sys.argv[1:]]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_info.py"
    if path.is_file():
        spec = importlib.util.spec_from_file_location("d3d_run_info", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.run_info(weights, argv)
    import shlex

    return {"cpu": cpu_name(), "weights": weights, "commit": "unknown", "command": shlex.join(argv)}


def _resolved_weights(args) -> str:
    """What --target-weights resolved to on this machine: 'q4' or 'fp32'."""
    import torch

    from sglang_d3d.engine.factory import engine_dtype
    from sglang_d3d.models.q4_target import resolve_target_weights, source_gguf

    dtype = getattr(torch, engine_dtype(args.dtype, args.device))
    try:
        return resolve_target_weights(args.target_weights, source_gguf(args.target), args.device,
                                      dtype)
    except Exception:  # noqa: BLE001 - a record must not stop the benchmark
        return "unknown"


def _recorded(fields: dict) -> dict:
    """The request's rules as JSON: the grammar as its kind and source."""
    spec = fields["grammar"]
    return fields | {"grammar": None if spec is None else {"kind": spec.kind, "source": spec.source}}


def _print(report: dict) -> None:
    cols = ["tokens_per_s", "speedup_vs_ar", "mean_accepted_length", "branch_hit_rate",
            "overlap_fraction", "mean_cycle_ms", "mean_draft_ms", "mean_verify_ms",
            "cycle_over_max_draft_verify", "copy_cycle_fraction"]
    print("mode   " + " ".join(f"{c[:14]:>14}" for c in cols))
    for m, s in report["modes"].items():
        vals = [s[c] for c in cols]
        print(f"{m:<6} " + " ".join(f"{v:>14.3f}" if isinstance(v, float) else f"{str(v):>14}" for v in vals))
    print("by cycle kind: share of cycles / of time, tokens a cycle, ms a cycle, tokens/s")
    for m, s in report["modes"].items():
        print(f"{m:<6} " + "  ".join(
            f"{k} {v['cycle_share']:.0%} / {v['time_share']:.0%}, {v['tokens_per_cycle']:.2f}, "
            f"{v['ms_per_cycle']:.1f} ms, {v['tokens_per_s']:.1f}" for k, v in s["by_kind"].items()))
    for m, table in report.get("calibration", {}).items():
        print(f"{m} calibrated (seconds per cycle by batch and plan): {table}")
    print(f"greedy outputs identical across modes: {report['greedy_identical']}")
