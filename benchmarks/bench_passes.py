"""How long one forward pass takes, target and drafter, at 1 and 2 intra-op threads.

Target (`TargetRunner`): an AR step (B=1) and verify passes of B tokens after a CTX-token
context, plus prefill throughput, on fp32 weights and (the default target) on its GGUF's 4-bit
weights ("target q4"), beside each one's bandwidth bound: the bytes a plain step reads over the
read bandwidth of a probe timed in turn with the plain steps, so that both meet the same load
from other processes. Drafter (`DraftRunner`, the shipped drafter, anchor layout): the
synchronous draft of one block after 1 or 3 newly accepted tokens, the pre-draft pass with 1 and
4 branches, and its prompt prefill; over the 4-bit target ("q4 base": its C++ layer loop,
models/exact_drafter.py, with inputs rounded to 8 bits as the engine drafts; beside it with the
target's 14-bit rounding) and its int8 copy. Median of REPS after a warm-up, and in parentheses the
fastest run (for the read bandwidth: the rate of its fastest run). The CPU target's goals (an
AR step <= 60 ms at 1 thread, a 16-token verify <= 1.5 AR steps, prefill >= 300 tok/s at 2
threads, a 4-bit plain step <= 1.5x its bound at 1 thread, median over median; a 4-bit verify
of 4 / 8 tokens <= 1.3x / 1.6x a 4-bit plain step, and with --block 4 the drafter's block on
the 4-bit target after one new token <= 1.5x) are printed under the table. Run it on an otherwise idle machine:

    .venv/bin/python benchmarks/bench_passes.py --threads 2 --block 4 \
        --json benchmarks/results/passes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_d3d.models import cpu_kernels, int8_linear, loading
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.packing import branch_pack, extend_pack
from sglang_d3d.models.q4_target import use_gguf_q4
from sglang_d3d.models.target import TargetRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

VERIFY_SIZES = (4, 8, 16)
BRANCHES = (1, 4)


def main() -> None:
    a = _args()
    torch.set_grad_enabled(False)
    hf = loading.load_hf_model(loading.resolve_target_path(a.target))
    target = Decoder.from_hf(hf)
    drafter = None if a.no_drafter else D3DDrafter.from_pretrained(
        loading.resolve_drafter_path(a.drafter), target).eval()
    q4 = q4_drafter = None
    if a.target is None:  # the default target: also on its GGUF's 4-bit weights
        q4 = Decoder.from_hf(hf)  # same HF modules, its own fused model
        use_gguf_q4(q4, loading.find_default_gguf(), q8_head=True)  # as the engine runs it
        if drafter is not None:
            q4_drafter = D3DDrafter.from_pretrained(loading.resolve_drafter_path(a.drafter), q4).eval()
    probe = _read_probe()
    rows: dict[str, dict[int, float]] = {}  # median
    mins: dict[str, dict[int, float]] = {}
    for th in a.threads:
        torch.set_num_threads(th)
        res = _target_passes(target, a, q4, probe)
        if drafter is not None:
            res.update(_drafter_passes(drafter, a, q4_drafter))
        res.update(_bounds(target, q4, a.ctx, res.pop(READ)))
        for name, (med, low) in res.items():
            rows.setdefault(name, {})[th] = med
            mins.setdefault(name, {})[th] = low
    _print_table(rows, mins, a.threads)
    goals = _goals(rows, mins)
    for line in goals["lines"]:
        print(line)
    if a.json:
        out = {**run_info(weights="fp32 and q4_1 (per row)"), "args": vars(a), "torch": torch.__version__,
               "kernels": cpu_kernels.describe_cpu(), "median": rows, "min": mins, "goals": goals["values"]}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="HF model folder (default: the default target)")
    p.add_argument("--ctx", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--block", type=int, default=16, help="drafter block size (the engine default)")
    p.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill row")
    p.add_argument("--no-drafter", action="store_true")
    p.add_argument("--plain", action="store_true",
                   help="also time the plain runner (HF modules, MKL), interleaved, for comparison")
    p.add_argument("--json", default=None, help="write the numbers here")
    return p.parse_args()


def _time_ms(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
    """name -> (median, min) ms of `reps` calls of each fn, interleaved (so that load from
    other processes hits them alike), after a warm-up (first-call allocations, weight
    packing). On a shared machine the minimum is the steadier of the two."""
    ts = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {n: (round(1e3 * statistics.median(t), 1), round(1e3 * min(t), 1)) for n, t in ts.items()}


def _target_passes(target: Decoder, a, q4: Decoder | None = None, probe=None) -> dict[str, tuple[float, float]]:
    """The runner as the engine uses it, on fp32 weights and (q4) on the GGUF's 4-bit ones;
    with --plain also the HF modules through F.linear and the LM head over every prompt
    token (the runner before its fast CPU path), interleaved; the read probe (READ)
    interleaved with the plain steps, so that a step and its bound meet the same load."""
    runners = {"target": TargetRunner(target, 1, max(a.ctx + 64, a.prefill + 1))}
    if q4 is not None:
        runners["target q4"] = TargetRunner(q4, 1, runners["target"].max_len)
    if a.plain:
        runners["plain target"] = TargetRunner(target, 1, runners["target"].max_len, fast=False)
    ctx = list(range(1000, 1000 + a.ctx))
    res = {}
    for r in runners.values():
        r.prefill(0, ctx)
    for b in (1, *VERIFY_SIZES):
        block = torch.arange(5, 5 + b).unsqueeze(0)  # [1, B]
        what = "AR step, B=1" if b == 1 else f"verify, B={b}"
        fns = {f"{label} {what}": (lambda r=r, blk=block: r.forward_block([0], blk)) for label, r in runners.items()}
        if b == 1 and probe is not None:
            fns[READ] = probe
        res.update(_time_ms(fns, a.reps))
    prompt = list(range(2000, 2000 + a.prefill))
    fns = {f"{label} prefill {a.prefill} tokens": _prefill_fn(label, r, prompt) for label, r in runners.items()}
    for name, ms in _time_ms(fns, max(1, a.reps // 3)).items():
        res[name] = ms
        res[name.replace(" tokens", ": tok/s")] = tuple(round(a.prefill / (x / 1e3), 1) for x in ms)
    return res


def _prefill_fn(label: str, r: TargetRunner, prompt: list[int]):
    if label.startswith("target"):
        return lambda: r.prefill(0, prompt)

    def old_prefill():  # the whole prompt in one pass, logits at every position
        r.lengths[0] = 0
        r.forward_block([0], torch.tensor([prompt]))

    return old_prefill


def _drafter_passes(drafter: D3DDrafter, a, q4: D3DDrafter | None = None) -> dict[str, tuple[float, float]]:
    """The shipped drafter as the engine runs it on CPU (fast path: the target's fused kernels
    on int8 weights plus the gated deltas) and, interleaved, on the fp32 weights, on the
    target's 4-bit weights (q4: the same drafter over the q4 target, fp32 deltas) and
    through its HF modules (fast=False)."""
    g = a.block - 1  # drafts under verification
    size = a.ctx + g + max(BRANCHES) * (a.block + 1) + 8
    int8 = int8_linear.use_int8("auto", drafter.mask_embedding.device, drafter.mask_embedding.dtype)
    runners = {"": DraftRunner(drafter, 1, max(size, a.prefill + 1), int8=int8),
               ", fp32 weights": DraftRunner(drafter, 1, size),
               ", HF modules": DraftRunner(drafter, 1, size, fast=False)}
    if q4 is not None:  # on the 4-bit target's C++ loop (models/exact_drafter.py), and its int8 copy
        runners[", q4 base"] = DraftRunner(q4, 1, size)  # 8-bit inputs, as the engine drafts
        runners[", q4 base, 14-bit inputs"] = DraftRunner(q4, 1, size, coarse=False)  # the target's rounding
        if int8:
            runners[", q4 int8 copy"] = DraftRunner(q4, 1, size, int8=True, exact_rows=0)
    if not int8:
        del runners[", fp32 weights"]  # the same as the first
    for r in runners.values():
        r.prefill(0, list(range(1000, 1000 + a.ctx)))

    def sync_draft(r, accepted):  # the accepted tokens + a block of masks; then undo them
        r.run([(0, extend_pack(list(range(7, 7 + accepted)), a.block))])
        r.rollback(0, accepted)

    res = {}
    for n in (1, 3):
        res.update(_time_ms({f"drafter sync draft, {n} new token{'s' if n > 1 else ''} + block "
                             f"{a.block}{v}": (lambda r=r, n=n: sync_draft(r, n))
                             for v, r in runners.items()}, a.reps))
    for k in BRANCHES:
        pack = branch_pack(list(range(5, 5 + g)), [(i, 7) for i in range(k)], a.block)
        name = f"drafter pre-draft, block {a.block}, {k} branch{'es' if k > 1 else ''}"
        res.update(_time_ms({name + v: (lambda r=r, p=pack: r.run([(0, p)]))
                             for v, r in runners.items()}, a.reps))
    r, prompt = runners[""], list(range(2000, 2000 + a.prefill))
    name = f"drafter prefill {a.prefill} tokens"
    res[name] = _time_ms({name: lambda: (r.reset(0), r.prefill(0, prompt))}, max(1, a.reps // 3))[name]
    res[name.replace(" tokens", ": tok/s")] = tuple(round(a.prefill / (x / 1e3), 1) for x in res[name])
    return res


def _bounds(target: Decoder, q4: Decoder | None, ctx: int,
            read_ms: tuple[float, float]) -> dict[str, tuple[float, float]]:
    """Bandwidth bound of a plain step (ms): the bytes it reads (projections, LM head, the
    context's keys and values) at the read bandwidth of the probe timed beside the steps,
    this thread count: (from the probe's median, from its fastest run)."""
    gbps = tuple(round(READ_MB * (1 << 20) / (ms / 1e3) / 1e9, 1) for ms in read_ms)
    res = {"memory read bandwidth, GB/s": gbps}
    for label, d in (("fp32", target), ("q4", q4)):
        if d is None:
            continue
        mb = _step_bytes(d, ctx) / 1e6
        res[f"plain step bytes read, {label}, MB"] = (round(mb, 1), round(mb, 1))
        res[f"plain step bandwidth bound, {label}"] = tuple(round(mb / g, 1) for g in gbps)
    return res


def _step_bytes(d: Decoder, ctx: int) -> int:
    """Weights one plain step reads (4-bit ones with their bf16 scales) plus the cache."""
    f = d.fused()

    def size(p) -> int:
        return p.nbytes if hasattr(p, "nbytes") else p.weight.numel() * p.weight.element_size()

    weights = sum(size(p) for layer in f.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    s = d.arch
    kv = 2 * d.num_layers * ctx * s.num_kv_heads * s.head_dim * d.embed_tokens.weight.element_size()
    return weights + size(f.lm_head) + kv


READ = "memory read probe"  # its timings become the bandwidth rows
READ_MB = 512


def _read_probe():
    """Read bandwidth probe: a READ_MB fp32 matrix times a vector (a GEMV reads each weight
    once, as a plain step does; torch's sum reads slower than a step's GEMVs do), larger
    than the caches."""
    cols = 1024
    w = torch.randn(READ_MB * (1 << 20) // 4 // cols, cols)
    x = torch.randn(cols)
    return lambda: torch.mv(w, x)


def _print_table(rows, mins, threads: list[int]) -> None:
    """Median (min) per pass and thread count."""
    print("| pass, median (min) | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads) + " |")
    print("|---|" + "---|" * len(threads))
    for name, by_t in rows.items():
        unit = "" if any(u in name for u in ("tok/s", "GB/s", "MB")) else " ms"
        cells = [f"{by_t[t]}{unit} ({mins[name][t]})" if t in by_t else "-" for t in threads]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _goals(rows, mins) -> dict:
    ar = rows.get("target AR step, B=1", {})
    v16 = rows.get("target verify, B=16", {})
    values, lines = {}, []
    if 1 in ar:
        values["ar_1thread_ms"] = ar[1]
        lines.append(f"goal AR step <= 60 ms (1 thread): {ar[1]} ms -> {'met' if ar[1] <= 60 else 'NOT met'}")
    for t in sorted(set(ar) & set(v16)):
        r = round(v16[t] / ar[t], 2)
        values[f"verify16_over_ar_{t}thread"] = r
        lines.append(f"goal verify B=16 <= 1.5 x AR ({t} thread(s)): {r}x -> {'met' if r <= 1.5 else 'NOT met'}")
    q4, bound = rows.get("target q4 AR step, B=1", {}), rows.get("plain step bandwidth bound, q4", {})
    q4_min, bound_min = mins.get("target q4 AR step, B=1", {}), mins.get("plain step bandwidth bound, q4", {})
    for t in sorted(set(q4) & set(bound)):
        r, r_min = round(q4[t] / bound[t], 2), round(q4_min[t] / bound_min[t], 2)
        values[f"q4_step_over_bound_{t}thread"] = r
        values[f"q4_step_over_bound_{t}thread_fastest"] = r_min
        lines.append(f"goal q4 AR step <= 1.5 x its bandwidth bound ({t} thread(s)), medians: {r}x -> "
                     f"{'met' if r <= 1.5 else 'NOT met'} (fastest step over fastest read: {r_min}x)")
    for b, most in ((4, 1.3), (8, 1.6)):
        vb = rows.get(f"target q4 verify, B={b}", {})
        for t in sorted(set(q4) & set(vb)):
            r = round(vb[t] / q4[t], 2)
            values[f"q4_verify{b}_over_step_{t}thread"] = r
            lines.append(f"goal q4 verify B={b} <= {most} x q4 AR step ({t} thread(s)): {r}x -> "
                         f"{'met' if r <= most else 'NOT met'}")
    draft = rows.get("drafter sync draft, 1 new token + block 4, q4 base", {})
    for t in sorted(set(q4) & set(draft)):
        r = round(draft[t] / q4[t], 2)
        values[f"q4_draft_block4_over_step_{t}thread"] = r
        lines.append(f"goal q4 drafter block-4 pass <= 1.5 x q4 AR step ({t} thread(s)): {r}x -> "
                     f"{'met' if r <= 1.5 else 'NOT met'}")
    pre = next((v for k, v in rows.items() if k.startswith("target prefill") and k.endswith("tok/s")), {})
    if 2 in pre:
        values["prefill_2thread_tok_s"] = pre[2]
        lines.append(f"goal prefill >= 300 tok/s (2 threads): {pre[2]} -> {'met' if pre[2] >= 300 else 'NOT met'}")
    return {"values": values, "lines": lines}


if __name__ == "__main__":
    main()
