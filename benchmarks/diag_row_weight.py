"""`d3d bench` with the third engine's controller on the traffic's acceptance rates alone.

The adaptive controller rates each decoding row by its own acceptance counts, with the
traffic's rates as their prior (engine/adaptive.py `blend`, `row_weight`). To compare that with
the traffic's rates alone side by side, list the same adaptive mode twice under two names;
the third engine built (the second of the two) gets `row_weight = 1e12`
(`diag_controller.py --engine 3 --set row_weight=1e12`):

    .venv/bin/python -m benchmarks.diag_row_weight --dataset gsm8k --num-prompts 30 \\
        --max-new-tokens 128 --branch-budget 1 --block-size 8 \\
        --modes ar,async-adaptive@8,async-adaptive-cut0@8
"""

from __future__ import annotations

import sys

from benchmarks.diag_controller import run

TRAFFIC_ONLY = 1e12  # a prior worth this many cycles: the row's own counts never matter

if __name__ == "__main__":
    sys.exit(run(["--engine", "3", "--set", f"row_weight={TRAFFIC_ONLY}", *sys.argv[1:]]))
