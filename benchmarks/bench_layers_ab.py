"""The C++ layer loop (models/csrc/exact_layers.cpp, with the block products it calls) of the
working tree against a git revision's, in one process: both are built under operator
namespaces of their own, a real pass of the default target on its 4-bit weights is run once
to capture the loop's arguments, and both builds are then called with them in alternating
order, round after round. Checks that they give the same bits.

    python benchmarks/bench_layers_ab.py --base HEAD --ctx 200,1000,2000 --rows 1,4,8 \\
        --json benchmarks/results/layers_ab.json

Prints, for each context and row count, the median ms of each build and the median of the
per-round ratios (working tree over base).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sglang_d3d.models import cpu_kernels, loading
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.q4_target import use_gguf_q4
from sglang_d3d.models.target import TargetRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from bench_kernels_ab import csrc_at, race  # noqa: E402
from run_info import run_info  # noqa: E402


def main() -> None:
    a = _args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels do not build here")
    loops = {"base": _build(a.base), "work": _build(None)}
    model = Decoder.from_hf(loading.load_hf_model(loading.resolve_target_path(None)))
    use_gguf_q4(model, loading.find_default_gguf(), q8_head=True)
    table = []
    for ctx in (int(c) for c in a.ctx.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            args, kwargs = _captured(model, ctx, rows)
            table.append({"ctx": ctx, "rows": rows, **race(loops, _calling(args, kwargs), a.rounds)})
            r = table[-1]
            print(f"ctx {ctx:>5}, rows {rows:>2}: base {r['base_ms']:7.2f} ms  work {r['work_ms']:7.2f} ms  "
                  f"x{r['ratio']:.3f}  {'same bits' if r['same_bits'] else 'BITS DIFFER'}", flush=True)
    if a.json:
        out = {**run_info(weights="q4_1 (default target), Q8_0 head"), "args": vars(a), "torch": torch.__version__,
               "results": table}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _build(rev: str | None):
    """exact_layers.cpp and block_mm.cpp at `rev` (None: the working tree), their operators
    under namespaces named by the sources' hash -> that build's exact_layers."""
    folder, digest = csrc_at(rev)
    ns = f"d3d_layers_{digest}"
    loop = folder / "exact_layers.cpp"
    loop.write_text(loop.read_text().replace("TORCH_LIBRARY(d3d_cpu, m)", f"TORCH_LIBRARY({ns}, m)"))
    cpu_kernels.build(ns, ("block_mm.cpp", "exact_layers.cpp"), ["-march=native", f"-DD3D_OPS={ns}_mm"],
                      folder=folder)
    return getattr(torch.ops, ns).exact_layers


def _captured(model: Decoder, ctx: int, rows: int) -> tuple[tuple, dict]:
    """The layer loop's arguments in a verify pass of `rows` tokens after `ctx` cached ones."""
    runner = TargetRunner(model, 1, ctx + rows + 1)
    runner.prefill(0, list(range(1000, 1000 + ctx)))
    block = torch.arange(5, 5 + rows).unsqueeze(0)  # [1, rows]
    loop_pass = model.fused().exact  # models/exact_pass.ExactPass
    seen = {}

    def spy(*args, **kwargs):
        seen["call"] = (args, kwargs)
        return torch.ops.d3d_cpu.exact_layers(*args, **kwargs)

    loop_pass._fn = spy
    try:
        runner.forward_block([0], block)
    finally:
        loop_pass._fn = torch.ops.d3d_cpu.exact_layers
    return seen["call"]


def _calling(args: tuple, kwargs: dict):
    """A loop build -> its output for these arguments (race's run)."""
    return lambda loop: [loop(*args, **kwargs)]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the git revision to compare against")
    p.add_argument("--ctx", default="200,1000,2000", help="cached tokens before the pass, comma-separated")
    p.add_argument("--rows", default="1,4,8", help="tokens in the pass, comma-separated")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
