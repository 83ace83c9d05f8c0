"""Do the target and the drafter really run at the same time on this machine?

Times a 16-token target verify alone, a pre-draft branch pass alone, and both at once (target
on a worker thread, drafter on the main thread, one intra-op thread each), on the default pair.
Prints and saves the ratio of the concurrent wall time to max(T_verify, T_draft): 1.0 is
perfect overlap, (T_verify + T_draft) / max(...) is none.

    .venv/bin/python benchmarks/bench_overlap.py --drafter PATH --out benchmarks/results/overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sglang_d3d.config import EngineConfig
from sglang_d3d.engine.factory import load_models
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.packing import branch_pack, extend_pack
from sglang_d3d.models.target import TargetRunner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--drafter", default=None)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    target, drafter, _ = load_models(EngineConfig(drafter_path=a.drafter))
    tr, dr = TargetRunner(target, 1, 2048), DraftRunner(drafter, 1, 2048)
    ctx = list(range(1000, 1000 + a.context))
    tr.prefill(0, ctx)
    dr.run([(0, extend_pack(ctx, 0))])
    block = torch.randint(0, 1000, (1, a.block))
    pack = branch_pack(list(range(a.block - 1)), [(i, 7) for i in range(a.branches)], a.block)

    def verify():
        tr.forward_block([0], block)

    def draft():
        dr.run([(0, pack)])

    pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))
    torch.set_num_threads(1)
    res = {"verify_ms": [], "draft_ms": [], "both_ms": []}
    for _ in range(a.repeats):
        res["verify_ms"].append(_ms(lambda: pool.submit(verify).result()))
        res["draft_ms"].append(_ms(draft))
        res["both_ms"].append(_ms(lambda: (lambda f: (draft(), f.result()))(pool.submit(verify))))
    med = {k: statistics.median(v) for k, v in res.items()}
    med["both_over_max"] = med["both_ms"] / max(med["verify_ms"], med["draft_ms"])
    med["sum_over_max"] = (med["verify_ms"] + med["draft_ms"]) / max(med["verify_ms"], med["draft_ms"])
    print(json.dumps(med, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "median": med, "raw": res}, indent=2) + "\n")


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


if __name__ == "__main__":
    main()
