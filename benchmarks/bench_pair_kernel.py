"""The AVX-512 pair kernel (models/csrc/block_mm.cpp, q4_pair_vnni) timed alone from L1: ns per
input row, pair of weight rows and octet of 8 blocks (512 weights), for the default target's
two input widths (576: the q, k, v, o, gate and up projections; 1536: down) and 1 to 8 input
rows, with the target's 14-bit inputs and the drafter's 8-bit ones. Beside each, the least
those 512 weights' byte dot products take at the rate `bench_floors.py` measures (16 a row and
pair-octet with 14-bit inputs, 8 with 8-bit ones).

    python benchmarks/bench_pair_kernel.py --json benchmarks/results/pair_kernel_xeon106.json

Medians of --reps rounds, each timing every configuration once over --calls calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

from sglang_d3d.models import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from bench_floors import rates_extension  # noqa: E402
from bench_kernels_ab import csrc_at  # noqa: E402
from run_info import run_info  # noqa: E402

HERE = Path(__file__).resolve().parent
ROWS = (1, 2, 4, 5, 8)
WIDTHS = (576, 1536)


def main() -> None:
    a = _args()
    ext = _build()
    floors = _floors(a.iterations)
    configs = [(width, coarse, rows) for width in WIDTHS for coarse in (False, True) for rows in ROWS]
    ns = {c: [] for c in configs}
    for _ in range(a.reps):  # every configuration once a round, so that the machine's mood meets them all
        for width, coarse, rows in configs:
            ns[(width, coarse, rows)].append(ext.ns_per_row_pair_octet(rows, coarse, width // 32, a.calls))
    if min(ns[configs[0]]) < 0:
        sys.exit("this build has no AVX-512 pair kernel (it needs AVX-512 VNNI)")
    results = []
    for (width, coarse, rows), times in ns.items():
        products = 8 if coarse else 16  # byte dot products a row and pair-octet
        r = {"inputs": width, "input_bits": 8 if coarse else 14, "rows": rows, "ns": round(statistics.median(times), 2),
             "dot_product_floor_ns": round(products * floors, 2)}
        results.append(r)
        print(f"{width:>5} inputs, {r['input_bits']:>2}-bit, {rows} rows: {r['ns']:6.2f} ns "
              f"(its dot products: {r['dot_product_floor_ns']:.2f})")
    if a.json:
        out = {**run_info(weights="random 4-bit, in L1"), "args": vars(a), "dpbusd_ns": floors, "results": results}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _build():
    """pair_kernel.cpp beside the working tree's models/csrc, as an extension named by their
    sources' hash."""
    folder, digest = csrc_at(None)
    (folder / "pair_kernel.cpp").write_bytes((HERE / "pair_kernel.cpp").read_bytes())
    ns = f"d3d_pair_{digest}_{hashlib.sha256((HERE / 'pair_kernel.cpp').read_bytes()).hexdigest()[:8]}"
    return cpu_kernels.build(ns, ("pair_kernel.cpp",), ["-march=native", f"-DD3D_OPS={ns}"], folder=folder, module=True)


def _floors(iterations: int) -> float:
    """ns a byte dot product, 1 thread (bench_floors.py's measurement)."""
    return min(rates_extension().ns_per_instruction("dpbusd", iterations, 1) for _ in range(3))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20_000, help="kernel calls a timing")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iterations", type=int, default=120_000_000, help="instructions the dot products' rate is timed over")
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
