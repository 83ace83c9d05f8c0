"""What a sampled drafter cycle spends drawing, on this machine: the drafts' draw (`sample_rows`,
by inverse CDF, against torch.multinomial) and a sampled tree's sibling race per depth
(`draw_without_replacement`, Exp(1) as -log(1 - U), against Tensor.exponential_), over a
vocabulary of the default target's size. Median of REPS after a warm-up; nothing asserted.

    .venv/bin/python benchmarks/bench_sampling_ops.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang_d3d.speculative.sampling import sample_rows
from sglang_d3d.speculative.tree_sampling import draw_without_replacement


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, default=4, help="drafter slots of a block (block 4)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if min(a.vocab, a.rows, a.reps, a.threads) < 1:
        p.error("--vocab, --rows, --reps and --threads must be at least 1")
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(3 * torch.randn(a.rows, a.vocab, generator=gen), -1)  # [R, V]
    noise = torch.empty(a.vocab)
    fns = {
        f"sample_rows, {a.rows} rows (inverse CDF)": lambda: sample_rows(q, gen),
        f"torch.multinomial, {a.rows} rows": lambda: torch.multinomial(q, 1, generator=gen),
        "draw_without_replacement, one depth, 3 draws": lambda: draw_without_replacement(q[0], 5, 3, gen),
        "Exp(1) noise: -log(1 - U)": lambda: torch.rand(a.vocab, generator=gen).neg_().log1p_().neg_(),
        "Exp(1) noise: Tensor.exponential_": lambda: noise.exponential_(generator=gen),
    }
    for name, fn in fns.items():
        print(f"{name}: {_median_ms(fn, a.reps):.3f} ms")


def _median_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


if __name__ == "__main__":
    main()
