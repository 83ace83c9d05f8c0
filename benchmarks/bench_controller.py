"""What the adaptive controller chooses and what each plan's cycles cost, at one concurrency.

ar and async (adaptive, the server's defaults unless overridden) engines share one target; the
prompts run in groups of --concurrency, each group through every engine in turn, each group
starting with the next engine (sglang_d3d/interleave.py). Prints every engine's tokens/s, then,
for each async one, the cycles per (batch, block) with their mean time, and the controller's
estimates per bucket. No timing is asserted; pause background jobs first.

`--plain-after-calibration`: the async engines decode plainly once calibrated (cycles of copies
still run), so that the cycles at each batch size compare what each engine adds to a plain
step (through the server, async's plain steps ran up to 25% slower than ar's in some rounds;
in one process they were level).

    .venv/bin/python benchmarks/bench_controller.py --concurrency 4 --num-prompts 16
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import DRAFT_WEIGHTS, SamplingParams
from sglang_d3d.engine.adaptive import PLAIN
from sglang_d3d.engine.calibrate import calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.interleave import rotated
from sglang_d3d.prompts import chat_ids, load_questions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p, adaptive=True)
    p.add_argument("--dataset", default="gsm8k",
                   help="one, or several comma-separated, served one after another (gsm8k,"
                        "mt_bench: a change of prompt kind)")
    p.add_argument("--num-prompts", type=int, default=16, help="per dataset")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (each prompt "
                   "sampled with its own seed otherwise)")
    p.add_argument("--also-min-explore", type=float, nargs="*", default=[],
                   help="more async engines, each with this controller min_explore "
                        "(1.0: every losing plan keeps its whole re-measurement share)")
    p.add_argument("--also-draft-weights", nargs="*", default=[], choices=list(DRAFT_WEIGHTS),
                   help="more async engines, each with these drafter weights (int8, full)")
    p.add_argument("--also-row-weight", type=float, nargs="*", default=[],
                   help="more async engines, each with this controller row_weight (1e12: "
                        "every row at the traffic's acceptance rates, its own counts unused)")
    p.add_argument("--also-controller", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="more async engines, each with this BlockController field set (a "
                        "number, or true/false), e.g. served_first=false")
    p.add_argument("--also-engine", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="more async engines, each with this EngineConfig field changed "
                        "(copy_ngram=0: no cycles of copies)")
    p.add_argument("--plain-after-calibration", action="store_true",
                   help="the async engines never speculate once calibrated (copies still run)")
    p.add_argument("--also-tree-nodes", type=int, nargs="*", default=[],
                   help="more async engines, each verifying token trees of this many drafts")
    a = p.parse_args()
    if a.concurrency < 1 or a.num_prompts < 1:
        p.error("--concurrency and --num-prompts must be at least 1")
    if a.temperature < 0:
        p.error("--temperature must be 0 (greedy) or more")
    if (a.also_min_explore or a.also_row_weight or a.also_controller) and not a.adaptive:
        p.error("--also-min-explore, --also-row-weight and --also-controller compare "
                "controllers: they need --adaptive")
    target, drafter, tok = load_models(engine_config(a, "async"))
    engines = {"ar": SpecEngine(engine_config(a, "ar"), target, None),
               "async": SpecEngine(engine_config(a, "async"), target, drafter)}
    settings = ([f"min_explore={m}" for m in a.also_min_explore]
                + [f"row_weight={w:g}" for w in a.also_row_weight] + a.also_controller)
    for setting in settings:
        e = SpecEngine(engine_config(a, "async"), target, drafter)
        _set_field(e.controller, setting)
        engines[f"async({setting})"] = e
    for n in a.also_tree_nodes:
        cfg = dataclasses.replace(engine_config(a, "async"), tree_nodes=n)
        engines[f"async(tree{n})"] = SpecEngine(cfg, target, drafter)
    for setting in a.also_engine:
        cfg = _replaced(engine_config(a, "async"), setting)
        engines[f"async({setting})"] = SpecEngine(cfg, target, drafter)
    for w in a.also_draft_weights:
        cfg = dataclasses.replace(engine_config(a, "async"), draft_weights=w)
        engines[f"async({w})"] = SpecEngine(cfg, target, drafter)
    prompts = [chat_ids(tok, q) for d in a.dataset.split(",")
               for q in load_questions(d, a.num_prompts)]
    params = [SamplingParams(max_new_tokens=a.max_new_tokens, stop_token_ids=(tok.eos_token_id,),
                             temperature=a.temperature, seed=i) for i in range(len(prompts))]
    generate(engines["ar"], prompts[:1], SamplingParams(max_new_tokens=8))  # first-call costs
    for name in [n for n in engines if n != "ar"] if a.calibrate else []:
        # as the server does at start-up (--no-calibrate: learn from traffic)
        t0 = time.perf_counter()
        table = calibrate(engines[name])
        print(f"{name} calibrated in {time.perf_counter() - t0:.1f} s: {table}")
    for name in [n for n in engines if n != "ar"] if a.plain_after_calibration else []:
        engines[name].plan = lambda *_, **__: PLAIN
    yields = {n: _watch_yields(e) for n, e in engines.items() if n != "ar"}
    seconds, tokens = collections.Counter(), collections.Counter()
    for i in range(0, len(prompts), a.concurrency):
        for name in rotated(list(engines), i // a.concurrency):
            e = engines[name]
            t0 = time.perf_counter()
            outs = generate(e, prompts[i : i + a.concurrency], params[i : i + a.concurrency])
            seconds[name] += time.perf_counter() - t0
            tokens[name] += sum(len(o.token_ids) for o in outs)
    print({n: f"{tokens[n] / seconds[n]:.1f} tok/s" for n in engines})
    for name in engines:
        print(name)
        _print_cycles(engines[name])
        if name in yields:
            _print_yields(yields[name])


def _set_field(controller, setting: str) -> None:
    """FIELD=VALUE onto the controller, VALUE typed as the field's current value."""
    name, value = _parsed(controller, setting, "--also-controller")
    setattr(controller, name, value)


def _replaced(cfg, setting: str):
    """The engine config with FIELD=VALUE, VALUE typed as the field's current value."""
    name, value = _parsed(cfg, setting, "--also-engine")
    return dataclasses.replace(cfg, **{name: value})


def _parsed(obj, setting: str, option: str) -> tuple[str, object]:
    name, _, text = setting.partition("=")
    if not hasattr(obj, name):
        raise SystemExit(f"{option}: {type(obj).__name__} has no field {name!r}")
    old = getattr(obj, name)
    if isinstance(old, bool):
        if text.lower() not in ("true", "false"):
            raise SystemExit(f"{option}: {name} takes true or false, not {text!r}")
        return name, text.lower() == "true"
    return name, type(old)(text)


def _watch_yields(engine: SpecEngine) -> dict:
    """(copied?) -> [row-cycles, tokens] from the engine's per-row cycle stats."""
    out = collections.defaultdict(lambda: [0, 0])

    def add(_request_id, c) -> None:
        out[c.copied][0] += 1
        out[c.copied][1] += c.num_accepted + 1

    engine.cycle_listeners.append(add)
    return out


def _print_yields(yields: dict) -> None:
    for copied, (n, t) in sorted(yields.items()):
        kind = "cycles of copies" if copied else "other cycles"
        print(f"{kind}: {n} row-cycles, {t / max(1, n):.2f} tokens a row-cycle")


def _print_cycles(engine: SpecEngine) -> None:
    per = collections.defaultdict(list)
    for c in engine.timeline.cycles:
        per[(c.batch, c.block, c.predraft_end > 0)].append(c.end)
    for (batch, block, pre), ts in sorted(per.items()):
        kind = " pre-drafted" if pre else ""
        print(f"batch {batch:2d} block {block:2d}{kind}: {len(ts):4d} cycles, "
              f"mean {1e3 * sum(ts) / len(ts):6.1f} ms")
    if engine.controller is None:
        return
    factors = {p.name: round(engine.controller.tree_factor(p), 3)
               for p in engine.controller.tree_yield}
    print(f"tree yield over chains, by plan: {factors}")
    rows = collections.defaultdict(list)
    for b, plan, s, t in sorted(engine.controller.snapshot()):
        rows[b].append(f"{plan.name} {1e3 * s:.0f} ms {t:.1f} tok/s")
    for b, cells in rows.items():
        print(f"bucket {b:2d}: " + "  ".join(cells))
    why = [f"{plan.name}@{b}:{reason}={n}"
           for (b, plan, reason), n in sorted(engine.controller.reasons()) if plan.block > 1]
    print(f"speculative cycles by why they ran: {' '.join(why) or 'none'}")


if __name__ == "__main__":
    main()
