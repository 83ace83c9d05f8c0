"""Does the order of side-by-side runs matter? Three engines over one target, always run in
the same order per group (ar, async restricted to plain decoding, ar again): with no order
effect the two ar engines would match. Why the benchmarks rotate modes (sglang_d3d/interleave.py).

    .venv/bin/python benchmarks/diag_order.py --num-prompts 24 --concurrency 4
"""

from __future__ import annotations

import argparse
import collections
import time

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import SamplingParams
from sglang_d3d.engine.adaptive import BlockController, Plan
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.prompts import chat_ids, load_questions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p, adaptive=True)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    a = p.parse_args()
    if a.num_prompts < 1 or a.concurrency < 1:
        p.error("--num-prompts and --concurrency must be at least 1")
    target, drafter, tok = load_models(engine_config(a, "async"))
    engines = {"ar": SpecEngine(engine_config(a, "ar"), target, None),
               "async (plain only)": SpecEngine(engine_config(a, "async"), target, drafter),
               "ar again": SpecEngine(engine_config(a, "ar"), target, None)}
    engines["async (plain only)"].controller = BlockController((Plan(1),))
    prompts = [chat_ids(tok, q) for q in load_questions("gsm8k", a.num_prompts)]
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    generate(engines["ar"], prompts[:1], SamplingParams(max_new_tokens=8))  # first-call costs
    seconds, tokens = collections.Counter(), collections.Counter()
    for i in range(0, len(prompts), a.concurrency):
        for name, e in engines.items():  # the fixed order under test
            t0 = time.perf_counter()
            outs = generate(e, prompts[i : i + a.concurrency], params)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += sum(len(o.token_ids) for o in outs)
    print({n: f"{tokens[n] / seconds[n]:.1f} tok/s" for n in engines})


if __name__ == "__main__":
    main()
