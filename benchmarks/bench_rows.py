"""Where each row of a 4-bit pass spends its time: the default target's passes of 1 to 16 rows
(a plain step, verify blocks), split into the layers' four projections, the LM head and the
rest (attention, norms, rounding, the runner), each timed over the model's own 30 layers so
that every weight streams from memory as in a pass.

    python benchmarks/bench_rows.py --threads 1 --json benchmarks/results/rows_xeon106.json

Each part prints its milliseconds at each row count, and what one more row costs past the first
(the slope a verify or drafter block pays per token). Medians of --reps runs, parts interleaved.
"projections 8-bit" is the same four projections with their inputs rounded to 8 bits, as the
drafter's passes round them (`--draft-input-bits 8`, models/csrc/block_mm.cpp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_d3d.models import loading
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.q4_target import use_gguf_q4
from sglang_d3d.models.target import TargetRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

ROWS = (1, 2, 4, 8, 16)
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def main() -> None:
    a = _args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    hf = loading.load_hf_model(loading.resolve_target_path(None))
    q4 = Decoder.from_hf(hf)
    use_gguf_q4(q4, loading.find_default_gguf(), q8_head=True)
    runner = TargetRunner(q4, 1, a.ctx + max(ROWS) + 1)
    runner.prefill(0, list(range(1000, 1000 + a.ctx)))
    table = {m: _parts(q4.fused(), runner, m, a.reps) for m in ROWS}
    _print(table)
    if a.json:
        out = {**run_info(weights="q4_1 (default target), Q8_0 head"), "args": vars(a),
               "torch": torch.__version__, "ms": table, "per_extra_row_ms": _slopes(table)}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _parts(model, runner: TargetRunner, m: int, reps: int) -> dict[str, float]:
    """Median ms of each part for a pass of m rows."""
    xs = {name: torch.randn(m, getattr(model.layers[0], name).in_features) for name in PROJECTIONS}
    h = torch.randn(m, model.lm_head.in_features)
    block = torch.arange(5, 5 + m).unsqueeze(0)  # [1, m]

    def projection(name):
        return lambda: [getattr(layer, name)(xs[name]) for layer in model.layers]

    def coarse():  # the four projections' products on 8-bit inputs (their biases left out)
        return [torch.ops.d3d_cpu.q4_mm(xs[name], *getattr(layer, name).operands, coarse=True)
                for layer in model.layers for name in PROJECTIONS]

    fns = {name: projection(name) for name in PROJECTIONS}
    fns["projections 8-bit"] = coarse
    fns["head"] = lambda: model.lm_head(h)
    fns["pass"] = lambda: runner.forward_block([0], block)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    ms = {k: round(statistics.median(v), 3) for k, v in times.items()}
    ms["projections"] = round(sum(ms[p] for p in PROJECTIONS), 3)
    ms["rest"] = round(ms["pass"] - ms["projections"] - ms["head"], 3)
    return ms


def _slopes(table: dict[int, dict[str, float]]) -> dict[str, float]:
    """ms one more row costs past the first, from 1 to 16 rows."""
    lo, hi = table[min(ROWS)], table[max(ROWS)]
    return {k: round((hi[k] - lo[k]) / (max(ROWS) - min(ROWS)), 3) for k in lo}


def _print(table: dict[int, dict[str, float]]) -> None:
    keys = [*PROJECTIONS, "projections", "head", "rest", "pass", "projections 8-bit"]
    print("rows " + "".join(f"{k.replace('projections', 'proj'):>12}" for k in keys))
    for m, ms in table.items():
        print(f"{m:>4} " + "".join(f"{ms[k]:>12.2f}" for k in keys))
    slopes = _slopes(table)
    print("+row " + "".join(f"{slopes[k]:>12.2f}" for k in keys))
    print("projections on 8-bit inputs over 14-bit: " +
          ", ".join(f"{m}: {ms['projections 8-bit'] / ms['projections']:.2f}x" for m, ms in table.items()))
    step = table[1]["pass"]
    print("pass of m rows over the plain step: " +
          ", ".join(f"{m}: {ms['pass'] / step:.2f}x" for m, ms in table.items()))


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=200, help="tokens in the cache before the pass")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args()
    if min(a.threads, a.ctx, a.reps) < 1:
        p.error("--threads, --ctx and --reps must be at least 1")
    return a


if __name__ == "__main__":
    main()
