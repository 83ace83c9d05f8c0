"""Host-side time per decoding cycle of the embedded engine: what a cycle spends in Python
around the target's and the drafter's passes (choosing the plan, looking up copies, the books
kept after the cycle), against the whole cycle, on the bundled prompts with `d3d bench`'s
settings (one mode, calibrated as the server starts).

    python benchmarks/bench_cycle_overhead.py --dataset mt_bench --num-prompts 4 --threads 2 \
        --json benchmarks/results/cycle_overhead_xeon106.json

On the 4-bit CPU path a plain step takes about 9 ms at 2 threads, so every 90 us here is 1% of
plain decoding's speed, which the adaptive plan must match where it does not speculate.
Each part prints its microseconds a cycle (its total over the cycles), and its share of the
mean cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang_d3d import bench
from sglang_d3d.bench import add_bench_args, run_bench
from sglang_d3d.engine.engine import SpecEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

# SpecEngine's parts of a cycle outside the passes, by what they do
PARTS = {"plan": "plan", "copies": "_copies", "books": "_observe", "emit": "_settle"}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    with tempfile.TemporaryDirectory() as tmp, _timers() as seconds:
        parser = argparse.ArgumentParser()
        add_bench_args(parser)
        out = Path(tmp) / "bench.json"
        run_bench(parser.parse_args(["--dataset", a.dataset, "--num-prompts", str(a.num_prompts),
                                    "--max-new-tokens", str(a.max_new_tokens), "--threads",
                                    str(a.threads), "--modes", a.mode, "--out", str(out)]))
        report = json.loads(out.read_text())["modes"][a.mode]
    cycles = seconds.pop("cycles")
    table = {name: {"us_per_cycle": 1e6 * s / cycles[1],
                    "share_of_cycle": s / cycles[0]} for name, (s, _) in seconds.items()}
    _print(table, cycles, report)
    if a.json:
        Path(a.json).write_text(json.dumps({
            **run_info(weights="target --target-weights auto"), "args": vars(a),
            "cycles": cycles[1], "mean_cycle_ms": 1e3 * cycles[0] / cycles[1],
            "tokens_per_s": report["tokens_per_s"], "by_kind": report.get("by_kind"),
            "parts": table}, indent=1) + "\n")


@contextmanager
def _timers() -> Iterator[dict[str, list[float]]]:
    """SpecEngine's parts wrapped in timers, counting inside the timed prompts only (not the
    warm-up or the calibration): name -> [seconds, calls]; "cycles" for _cycle, whose time
    holds the copies', the books' and the emits' (the plan's is before it)."""
    seconds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    timing = [False]
    originals = {attr: getattr(SpecEngine, attr) for attr in [*PARTS.values(), "_cycle"]}
    prompt = bench._timed

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timing[0]:
                    seconds[name][0] += time.perf_counter() - t0
                    seconds[name][1] += 1
        return run

    def timed_prompt(*args, **kwargs):
        timing[0] = True
        try:
            return prompt(*args, **kwargs)
        finally:
            timing[0] = False

    for name, attr in [*PARTS.items(), ("cycles", "_cycle")]:
        setattr(SpecEngine, attr, timed(name, originals[attr]))
    bench._timed = timed_prompt
    try:
        yield seconds
    finally:
        for attr, fn in originals.items():
            setattr(SpecEngine, attr, fn)
        bench._timed = prompt


def _print(table: dict, cycles: list[float], report: dict) -> None:
    print(f"{cycles[1]} cycles, {1e3 * cycles[0] / cycles[1]:.2f} ms a cycle, "
          f"{report['tokens_per_s']:.1f} tokens/s")
    for name, row in table.items():
        print(f"  {name:8s} {row['us_per_cycle']:8.1f} us a cycle  {100 * row['share_of_cycle']:5.2f}%")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="mt_bench", help="gsm8k | mt_bench | mbpp")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="async-adaptive", help="one `d3d bench` mode")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or a.max_new_tokens < 1 or a.threads < 1:
        p.error("--num-prompts, --max-new-tokens and --threads must be at least 1")
    return a


if __name__ == "__main__":
    main()
