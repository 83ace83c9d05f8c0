"""What the drafter's low-rank deltas cost per pass, side by side: the same passes with the
deltas computed three ways, interleaved so machine noise hits them alike.

    gather    mask rows gathered and scattered back (index_select / index_add), torch's GEMM
    views     mask rows as one run of rows (a batch of one), torch's GEMM
    openblas  views, and numpy's OpenBLAS for the small products (the engine's path)

Passes (the shipped drafter, CTX-token context, batch 1): a verify of 8 clean tokens (no
deltas, the yardstick), a synchronous draft (anchor + 7 masks), and a fused pass (4 verify
tokens + 3 masks anchored at the first).

    /work/bg/quiet .venv/bin/python benchmarks/bench_deltas.py --json benchmarks/results/deltas.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from sglang_d3d.models import adapters, loading
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.fused_runner import FusedRunner
from sglang_d3d.models.packing import extend_pack, fused_pack
from sglang_d3d.models.target import TargetRunner

WAYS = ("gather", "views", "openblas")


@contextmanager
def deltas_by(way: str):
    """Switch the delta path for the duration: no run of rows (gather), no OpenBLAS (views)."""
    rows, set_gate = adapters.SmallDelta.MAX_ROWS, adapters.Gate.set

    def no_span(self, is_mask, dtype):
        set_gate(self, is_mask, dtype)
        self.span = None

    if way != "openblas":
        adapters.SmallDelta.MAX_ROWS = 0
    if way == "gather":
        adapters.Gate.set = no_span
    try:
        yield
    finally:
        adapters.SmallDelta.MAX_ROWS, adapters.Gate.set = rows, set_gate


def main() -> None:
    a = _args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    target = Decoder.from_hf(loading.load_hf_model(loading.resolve_target_path(None)))
    drafter = D3DDrafter.from_pretrained(loading.resolve_drafter_path(a.drafter), target).eval()
    prompt = list(range(1000, 1000 + a.ctx))
    runner = TargetRunner(target, 1, a.ctx + 64)
    runner.prefill(0, prompt)
    draft = DraftRunner(drafter, 1, a.ctx + 64)
    draft.prefill(0, prompt[:-1])
    fused = FusedRunner(drafter, runner)
    fns = {"verify 8 (no deltas)": lambda: runner.forward_block([0], torch.tensor([prompt[-8:]]))}
    for way in WAYS:
        fns[f"sync draft, {way}"] = _in(way, lambda: _sync_draft(draft, prompt[-1]))
        fns[f"fused 4+3, {way}"] = _in(way, lambda: fused.run([(0, fused_pack(prompt[-4:], [0], 4))]))
    ms = _interleaved(fns, a.reps)
    for name, v in ms.items():
        print(f"{name:<28}{v:8.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "median_ms": ms}, indent=1) + "\n")


def _in(way: str, fn):
    def run():
        with deltas_by(way):
            fn()
    return run


def _sync_draft(draft: DraftRunner, anchor: int) -> None:
    draft.run([(0, extend_pack([anchor], 8))])
    draft.rollback(0, 1)  # the same pass each time


def _interleaved(fns: dict, reps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in times.items()}


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=None)
    p.add_argument("--ctx", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
