"""Does an async engine's plain step cost more than ar's? Both engines on one target in one
process, the async engine's plan forced to plain decoding (after its start-up calibration,
unless `--no-calibrate`), the same prompts through each in turn, order alternating. Prints
each engine's plain-step time at the chosen batch size and the whole decoding time.

Why: through the server at concurrency 16 async's plain steps ran up to 25% slower than ar's
in some rounds (benchmarks/results/README.md, sitting 25); this separates what the engine
adds from what the server process's own speed does.

    D3D_DATASETS=../shared/datasets .venv/bin/python benchmarks/diag_plain_steps.py \
        --dataset mt_bench --num-prompts 80 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.adaptive import PLAIN
from sglang_d3d.engine.calibrate import calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.prompts import chat_ids, load_questions


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mt_bench")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--batch", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_engine_args(p, adaptive=True)
    return p.parse_args()


def engines(args: argparse.Namespace) -> tuple[dict[str, SpecEngine], object]:
    target, drafter, tok = load_models(engine_config(args, "async"))
    ar = SpecEngine(engine_config(args, "ar"), target, None)
    spec = SpecEngine(engine_config(args, "async"), target, drafter)
    if args.calibrate:  # as a server starts: the drafter's passes run before any request
        calibrate(spec)
    spec.plan = lambda *a, **k: PLAIN  # from here on it never speculates
    return {"ar": ar, "async": spec}, tok


def main() -> None:
    args = parse()
    pair, tok = engines(args)
    prompts = [chat_ids(tok, q) for q in load_questions(args.dataset, args.num_prompts)]
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, seed=i,
                             stop_token_ids=(tok.eos_token_id,)) for i in range(len(prompts))]
    steps: dict[str, list[float]] = defaultdict(list)  # plain steps at `batch` rows, seconds
    for name, e in pair.items():
        generate(e, prompts[:1], SamplingParams(max_new_tokens=8))  # warm both up alike
        e.plan_listeners.append(lambda n, plan, s, name=name:
                                steps[name].append(s) if n == args.batch and plan == PLAIN else None)
    total: dict[str, float] = defaultdict(float)
    for k, i in enumerate(range(0, len(prompts), args.batch)):
        order = list(pair) if k % 2 == 0 else list(reversed(pair))
        for name in order:
            t0 = time.perf_counter()
            generate(pair[name], prompts[i:i + args.batch], params[i:i + args.batch])
            total[name] += time.perf_counter() - t0
    for name, v in steps.items():
        print(f"{name:6s} plain steps at batch {args.batch}: {len(v)}, mean "
              f"{1000 * statistics.fmean(v):.1f} ms, median {1000 * statistics.median(v):.1f} ms; "
              f"all decoding {total[name]:.2f} s")


if __name__ == "__main__":
    main()
