"""How D3D's passes scale on one GPU, and whether the drafter really overlaps the verify.

For each model shape (random weights, gpu_shapes.py): the target's AR step, its verify pass at
block sizes 4/8/16, the drafter's branch pass for 1/4/17 branches, fused passes (a verify block
of B with k mask blocks anchored at its tokens, the whole of a fused-mode cycle), and one async cycle (the
drafter on its own thread and CUDA stream, as in both hosts' speculative Executor, while the
target verifies a block of 16) against the same two passes back to back, as
cycle / max(draft, verify): 1.0 is perfect overlap, (draft + verify) / max is none. Then a
projected speedup from the accepted lengths measured on CPU (gpu_report.py): a projection, not
a measurement. Batch 1 throughout; one JSON file and a printed table.

    python benchmarks/gpu_scale.py --out benchmarks/results/gpu_scale.json
    python benchmarks/gpu_scale.py --device cpu --tiny      # the whole script, on CPU, in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gpu_report import acceptance_sources, print_table, projections
from gpu_shapes import BLOCK, DEFAULT_SHAPES, SHAPES, build_drafter, build_target

from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.fused_runner import FusedRunner
from sglang_d3d.models.packing import branch_pack, extend_pack, fused_pack
from sglang_d3d.models.target import TargetRunner
from sglang_d3d.speculative.drafting import draft_cache_len
from sglang_d3d.speculative.executor import Executor


@dataclass(frozen=True)
class Plan:
    context: int = 512  # tokens already in both caches
    blocks: tuple[int, ...] = (4, 8, 16)  # verify block sizes
    branches: tuple[int, ...] = (1, 4, 17)  # pre-drafted branches per drafter pass
    fused: tuple[tuple[int, int], ...] = ((4, 1), (8, 2), (16, 4), (16, 16))  # (block, branches)
    warmup: int = 3
    iters: int = 10


TINY_PLAN = Plan(context=16, warmup=1, iters=2)


# ---- timing -------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, plan: Plan) -> float:
    return interleaved_ms({"fn": fn}, device, plan)["fn"]


def interleaved_ms(fns: dict, device: torch.device, plan: Plan) -> dict[str, float]:
    """Median wall time of each fn(), the device drained before and after every call. The fns
    take turns within each iteration, so machine noise hits them alike and ratios stay fair."""
    for _ in range(plan.warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(plan.iters):
        for name, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(1e3 * (time.perf_counter() - t))
    return {name: statistics.median(ts) for name, ts in times.items()}


# ---- one shape ----------------------------------------------------------------------------------
class Passes:
    """The target and the drafter with `context` tokens cached, and the passes to time."""

    def __init__(self, target, drafter, plan: Plan, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        vocab = target.arch.vocab_size
        prompt = torch.randint(0, vocab, (plan.context,), generator=g).tolist()
        scratch = max(b + k * (b - 1) for b, k in plan.fused)  # a fused pack past the context
        self.target = TargetRunner(target, 1, plan.context + max(max(plan.blocks), scratch) + 1)
        size = draft_cache_len(plan.context, BLOCK, BLOCK, max(plan.branches))
        self.drafter = DraftRunner(drafter, 1, size)
        self.target.prefill(0, prompt)
        self.drafter.run([(0, extend_pack(prompt, 0))])  # block 0: just cache the prompt
        self.blocks = {b: torch.randint(0, vocab, (1, b), generator=g) for b in plan.blocks}
        drafts = torch.randint(0, vocab, (BLOCK - 1,), generator=g).tolist()
        hypotheses = [(i % BLOCK, (7 * i) % vocab) for i in range(max(plan.branches))]
        self.packs = {k: branch_pack(drafts, hypotheses[:k], BLOCK) for k in plan.branches}
        self.fused_runner = FusedRunner(drafter, self.target)
        self.fused_packs = {
            (b, k): fused_pack(torch.randint(0, vocab, (b,), generator=g).tolist(),
                               list(range(b))[-k:], b)
            for b, k in plan.fused
        }

    def fused(self, block: int, branches: int) -> None:
        """One fused-mode pass: verify `block` tokens, draft `branches` next blocks."""
        self.fused_runner.run([(0, self.fused_packs[(block, branches)])])  # commits nothing

    def verify(self, block: int) -> None:
        self.target.forward_block([0], self.blocks[block])  # writes scratch, commits nothing

    def ar_step(self) -> None:
        self.target.forward_block([0], self.blocks[min(self.blocks)][:, :1])  # one token

    def draft(self, branches: int) -> None:
        self.drafter.run([(0, self.packs[branches])])  # branch packs commit nothing


def measure_shape(shape, plan: Plan, device: torch.device, dtype: torch.dtype) -> dict:
    t0 = time.perf_counter()
    target = build_target(shape, device, dtype)
    passes = Passes(target, build_drafter(target), plan)
    out = {
        "shape": asdict(shape),
        "build_s": time.perf_counter() - t0,
        **measure_passes(passes, plan, device),
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def measure_passes(passes: Passes, plan: Plan, device: torch.device) -> dict:
    fns = {"ar": passes.ar_step}
    fns.update({f"v{b}": (lambda b=b: passes.verify(b)) for b in plan.blocks})
    fns.update({f"d{k}": (lambda k=k: passes.draft(k)) for k in plan.branches})
    fns.update({f"f{b}x{k}": (lambda b=b, k=k: passes.fused(b, k)) for b, k in plan.fused})
    with torch.inference_mode():
        ms = interleaved_ms(fns, device, plan)
    return {
        "ar_step_ms": ms["ar"],
        "verify_ms": {b: ms[f"v{b}"] for b in plan.blocks},
        "draft_ms": {k: ms[f"d{k}"] for k in plan.branches},
        "fused": [{"block": b, "branches": k, "ms": ms[f"f{b}x{k}"]} for b, k in plan.fused],
        "cycle": {k: measure_cycle(passes, k, device, plan) for k in plan.branches},
    }


def release(device: torch.device) -> None:
    """Give the last shape's memory back before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_cycle(passes: Passes, branches: int, device, plan: Plan) -> dict:
    """A verify of one block of 16 with a `branches` pre-draft on the drafter's thread and
    stream, against the same two passes alone and back to back on one stream."""
    executor = Executor(device)
    block = max(plan.blocks)

    def overlapped():
        pending = executor.submit(passes.draft, branches)
        passes.verify(block)
        _sync(device)
        pending.result()  # the drafter's stream is synchronised inside

    def back_to_back():
        passes.draft(branches)
        passes.verify(block)

    fns = {
        "draft": lambda: passes.draft(branches),
        "verify": lambda: passes.verify(block),
        "async_cycle": overlapped,
        "back_to_back": back_to_back,
    }
    try:
        with torch.inference_mode():
            ms = interleaved_ms(fns, device, plan)
    finally:
        executor.shutdown()
    longer = max(ms["draft"], ms["verify"])
    return {
        **{f"{k}_ms": v for k, v in ms.items()},
        "cycle_over_max": ms["async_cycle"] / longer,
        "back_to_back_over_max": ms["back_to_back"] / longer,
    }


# ---- the run ------------------------------------------------------------------------------------
def environment(device: torch.device, dtype: torch.dtype) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = None
    return env


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy sizes of each shape (CPU check)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=None, help="cached tokens (default 512)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--accepted", nargs="*", default=None, help="CPU `d3d bench` JSON files")
    p.add_argument("--out", default="benchmarks/results/gpu_scale.json")
    p.add_argument("--pytest-rc", type=int, default=None, help="gpu_check.sh: pytest -m gpu status")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan = TINY_PLAN if a.tiny else Plan()
    plan = Plan(
        **{**asdict(plan), **{k: v for k, v in (("context", a.context), ("iters", a.iters)) if v}}
    )
    torch.set_grad_enabled(False)
    result = {
        "environment": environment(device, dtype),
        "pytest_gpu_rc": a.pytest_rc,  # 0: the CUDA-path tests passed (None: not run)
        "plan": asdict(plan),
        "shapes": {},
    }
    for name in a.shapes:
        shape = SHAPES[name].tiny() if a.tiny else SHAPES[name]
        print(f"[gpu_scale] {shape.name} ...", flush=True)
        result["shapes"][name] = measure_shape(shape, plan, device, dtype)
        release(device)
    sources = acceptance_sources(a.accepted)
    result["projection"] = projections(result["shapes"], sources)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"[gpu_scale] wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
