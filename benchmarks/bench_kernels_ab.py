"""The block products of the working tree against those of a git revision, in one process: the
revision's models/csrc/block_mm.cpp is built again under an operator namespace of its own, and
both builds run the default target's shapes (its 30 layers' four projections with random 4-bit
weights, so that every weight streams from memory as in a pass, and its Q8_0 LM head) in
alternating order, round after round. On a shared machine whose speed moves by 10-40% within
minutes, only such interleaved ratios tell a kernel change from the machine's mood.

    python benchmarks/bench_kernels_ab.py --base HEAD --rows 1,5,9,16 \\
        --json benchmarks/results/kernels_ab.json

Prints, for each part and row count, the median ms of each build and the median of the
per-round ratios (working tree over base; below 1 is faster), and whether the two gave the same
bits (a change meant to keep every output exact must).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sglang_d3d.models import cpu_kernels
from sglang_d3d.models.q4_linear import Q4Blocks, pack_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import ROOT, run_info  # noqa: E402

CSRC = "sglang_d3d/models/csrc"


def main() -> None:
    a = _args()
    torch.set_num_threads(a.threads)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels do not build here")
    ops = {"base": _build_revision(a.base), "work": torch.ops.d3d_cpu}
    layers = [_layer(a.hidden, a.intermediate, a.kv, seed) for seed in range(a.layers)]
    head = (torch.randint(-127, 128, (a.vocab, a.hidden), dtype=torch.int8),
            (torch.rand(a.vocab, a.hidden // 32) * 0.01).half())
    rows = [int(r) for r in a.rows.split(",")]
    table = []
    for m in rows:
        for part, run in _parts(layers, head, m).items():
            table.append({"rows": m, "part": part, **race(ops, run, a.rounds)})
            _print_row(table[-1])
    if a.json:
        out = {**run_info(weights="q4_1 random, default target's shapes; Q8_0 head"), "args": vars(a),
               "torch": torch.__version__, "results": table}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def csrc_at(rev: str | None) -> tuple[Path, str]:
    """models/csrc at git revision `rev` (None: the working tree) copied into a new folder ->
    (the folder, a hash of its sources)."""
    folder = Path(tempfile.mkdtemp(prefix="d3d_ab_"))
    digest = hashlib.sha256()
    names = sorted(p.name for p in (ROOT / CSRC).iterdir()) if rev is None else \
        subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout.split()
    for name in names:
        text = (ROOT / CSRC / name).read_bytes() if rev is None else \
            subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True).stdout
        (folder / name).write_bytes(text)
        digest.update(text)
    return folder, digest.hexdigest()[:12]


def _build_revision(rev: str):
    """models/csrc at `rev`, its block products built as torch.ops.d3d_ab_<hash of its sources>."""
    folder, digest = csrc_at(rev)
    ns = f"d3d_ab_{digest}"
    cpu_kernels.build(ns, ("block_mm.cpp",), ["-march=native", f"-DD3D_OPS={ns}"], folder=folder)
    return getattr(torch.ops, ns)


def _layer(hidden: int, intermediate: int, kv: int, seed: int) -> dict[str, tuple]:
    """One layer's four projections (fused as the target runs them) in q4_mm's layout."""
    gen = torch.Generator().manual_seed(seed)

    def blocks(n: int, k: int) -> tuple:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        return (k, pack_blocks(Q4Blocks(q, d, -d * 8)))

    return {"qkv": blocks(hidden + 2 * kv, hidden), "o": blocks(hidden, hidden),
            "gate_up": blocks(2 * intermediate, hidden), "down": blocks(hidden, intermediate)}


def _parts(layers: list[dict], head: tuple, m: int) -> dict:
    """part -> fn(ops) running it over every layer, -> its last output (for the bits check)."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for k in {k for k, _ in layers[0].values()}}
    xh = torch.randn(m, head[0].shape[1], generator=gen)

    def projections(coarse: bool):
        def run(ops):
            return [ops.q4_mm(xs[k], *w, False, coarse) for layer in layers for k, w in layer.values()]
        return run

    return {"projections": projections(False), "projections 8-bit": projections(True),
            "head": lambda ops: [ops.q8_mm(xh, *head)]}


def race(ops: dict, run, rounds: int) -> dict:
    """Median ms of each build (`run(build)` -> its outputs), and the median per-round ratio
    work / base, alternating which goes first; plus whether the outputs are the same bits."""
    same = all(torch.equal(x, y) for x, y in zip(run(ops["base"]), run(ops["work"])))
    ms = {k: [] for k in ops}
    for r in range(rounds):
        for k in (("base", "work") if r % 2 else ("work", "base")):
            start = time.perf_counter()
            run(ops[k])
            ms[k].append((time.perf_counter() - start) * 1e3)
    ratio = statistics.median(w / b for w, b in zip(ms["work"], ms["base"]))
    return {"base_ms": round(statistics.median(ms["base"]), 3), "work_ms": round(statistics.median(ms["work"]), 3),
            "ratio": round(ratio, 3), "same_bits": same}


def _print_row(r: dict) -> None:
    print(f"{r['part']:<18} rows {r['rows']:>3}: base {r['base_ms']:8.2f} ms  work {r['work_ms']:8.2f} ms  "
          f"x{r['ratio']:.3f}  {'same bits' if r['same_bits'] else 'BITS DIFFER'}", flush=True)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the git revision to compare against")
    p.add_argument("--rows", default="1,5,9,16", help="input rows per pass, comma-separated")
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds per part")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv", type=int, default=192, help="the key (and value) projection's outputs")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
