"""The target's verify pass at batch 1 by width (200-token context, 2 threads): what a token tree
of N drafts costs against a chain of fewer. Prints the mean of the middle 5 of 7 timings per
width, widths interleaved so machine noise hits them alike. No timing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/diag_verify_width.py
"""

from __future__ import annotations

import time

import torch

from sglang_d3d.config import EngineConfig, Mode
from sglang_d3d.engine.factory import load_models
from sglang_d3d.models.target import TargetRunner

WIDTHS = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32)


def main() -> None:
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    target, _, _ = load_models(EngineConfig(mode=Mode.AR))
    runner = TargetRunner(target, 1, 512)
    runner.prefill(0, list(range(100, 300)))
    times: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for _ in range(7):
        for w in WIDTHS:
            x = torch.randint(100, 1000, (1, w))
            t0 = time.perf_counter()
            runner.forward_block([0], x)  # writes past the committed length: nothing to undo
            times[w].append(1e3 * (time.perf_counter() - t0))
    for w, ts in times.items():
        mid = sorted(ts)[1:-1]
        print(f"width {w:2d}: {sum(mid) / len(mid):5.1f} ms")


if __name__ == "__main__":
    main()
