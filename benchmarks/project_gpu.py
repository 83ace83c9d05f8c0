"""A GPU projection, on paper until measured: speedups of ar, sync and async at batch 1 to 64.

PROJECTION, not a measurement. It multiplies two things:
- acceptance measured on CPU by `d3d bench` (SmolLM2-135M target, the shipped drafter, greedy,
  fixed plans at block 8 with 4 pre-drafted branches): per kind of cycle, its share and tokens
  a cycle (`by_kind`: drafting cycles and cycles of corpus copies, which skip the drafter), and
  the async branch hit rate;
- a cost model of each GPU pass: a roofline (bytes over memory bandwidth, flops over peak, the
  larger of the two) at the Qwen3-8B shape, bf16. Where benchmarks/gpu_check.sh has written
  its JSON, each kind of pass is scaled by its measured time over the roofline's at batch 1
  (assumed to carry over to larger batches), and the roofline's error is printed.

Two placements of the drafter, a full-depth D3D drafter (every target layer, as gpu_shapes.py
builds it): (a) on the target's H200, on a second stream: passes that overlap share the GPU,
so an overlapped cycle costs the roofline of both passes' bytes and flops together; (b) on a
second H200 with its own copy of the layers: an overlapped cycle costs the longer pass plus a
hand-over. Batch effects: a cycle of copies needs every row to have a copy, taken as the
measured share to the power of the batch (rows independent); an async cycle needs a
synchronous draft when any row's branches missed.

    .venv/bin/python benchmarks/project_gpu.py
    .venv/bin/python benchmarks/project_gpu.py --measured benchmarks/results/gpu_check.json

The SGLang worker's own table takes the tokens a speculative cycle from bench_sglang.py's CPU
run (benchmarks/results/sglang_cpu.json: chains drafted by the shared full-depth drafter) and
compares, per batch, SGLang alone (graphed, and eager), the worker's cycle as built (an eager
draft pass and an eager verify) and a one-pass cycle (the next block's mask rows for every
outcome inside one graphed verify). Eager passes add an assumed launch cost per kernel.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from gpu_report import RESULTS, _nearest, drafting_tau
from gpu_shapes import SHAPES, Shape


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s of HBM
    peak_flops: float  # dense bf16 flop/s
    handover_ms: float  # one cross-GPU hand-over per cycle (placement b)


# H200 SXM datasheet figures: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16. The hand-over moves a
# few KB of tokens and hidden rows over NVLink plus an event wait: taken as 0.05 ms.
H200 = Hardware("H200", 4.8e12, 989e12, 0.05)
BYTES = 2  # bf16
BATCHES = (1, 2, 4, 8, 16, 32, 64)
SOURCES = ("bench_fixed_gsm8k30.json", "bench_fixed_mt_bench20.json")
MEASURED = RESULTS / "gpu_check.json"


@dataclass(frozen=True)
class Pass:
    bytes: float
    flops: float


@dataclass(frozen=True)
class Scale:
    """Measured over roofline time, per kind of pass (1.0: the roofline as it is)."""

    ar: float = 1.0
    verify: float = 1.0
    draft: float = 1.0


@dataclass(frozen=True)
class Acceptance:
    """One CPU `d3d bench` row, by kind of cycle."""

    source: str
    mode: str  # "sync" | "async"
    block: int  # verify width B (drafts + 1)
    branches: int  # pre-drafted branches an async cycle (branch budget)
    draft_tokens: float  # tokens a drafting cycle
    copy_tokens: float  # tokens a cycle of copies
    copy_share: float  # cycles of copies over all cycles, at batch 1
    hit_rate: float  # async: pre-drafted branch holding the next block


# ---- cost model (pure) --------------------------------------------------------------------------
def layer_params(s: Shape) -> int:
    attention = s.hidden * s.head_dim * (s.heads + 2 * s.kv_heads) + s.heads * s.head_dim * s.hidden
    return attention + 3 * s.hidden * s.intermediate


def weight_bytes(s: Shape) -> float:
    """Bytes read by one pass: every layer and the LM head (the embedding is a gather)."""
    return BYTES * (s.layers * layer_params(s) + s.vocab * s.hidden)


def kv_bytes_per_token(s: Shape) -> float:
    return BYTES * s.layers * 2 * s.kv_heads * s.head_dim


def forward_pass(s: Shape, batch: int, tokens: int, context: int) -> Pass:
    """One pass over `tokens` new tokens in each of `batch` rows with `context` cached."""
    n = batch * tokens
    matmul = 2 * n * (s.layers * layer_params(s) + s.vocab * s.hidden)
    attention = 4 * n * s.layers * s.heads * s.head_dim * (context + tokens)
    kv = batch * (context + tokens) * kv_bytes_per_token(s)
    return Pass(weight_bytes(s) + kv, matmul + attention)


def roofline_ms(p: Pass, hw: Hardware) -> float:
    return 1e3 * max(p.bytes / hw.bandwidth, p.flops / hw.peak_flops)


def together(a: Pass, b: Pass) -> Pass:
    """Two passes sharing one GPU: their bytes and flops add up."""
    return Pass(a.bytes + b.bytes, a.flops + b.flops)


@dataclass(frozen=True)
class Costs:
    """ms of each pass at one batch, placement and acceptance row."""

    ar: float
    verify: float
    draft_one: float  # a synchronous draft: one block a row
    overlapped: float  # an async cycle: verify with the next blocks' pre-draft alongside


def costs(s: Shape, hw: Hardware, acc: Acceptance, batch: int, context: int, two_gpus: bool,
          scale: Scale = Scale()) -> Costs:
    """Pass times at `batch`. The drafter's pass is a full-depth pass over one block of mask
    slots per branch; its cache holds the same context."""
    ar_p = forward_pass(s, batch, 1, context)
    verify_p = forward_pass(s, batch, acc.block, context)
    draft_one_p = forward_pass(s, batch, acc.block, context)
    pre_draft_p = forward_pass(s, batch, acc.block * max(1, acc.branches), context)
    verify, pre_draft = scale.verify * roofline_ms(verify_p, hw), scale.draft * roofline_ms(
        pre_draft_p, hw)
    if two_gpus:
        overlapped = max(verify, pre_draft) + hw.handover_ms
    else:  # one GPU: the roofline of both, each kind's scale weighted by its own share
        alone = verify + pre_draft
        shared = roofline_ms(together(verify_p, pre_draft_p), hw)
        raw = roofline_ms(verify_p, hw) + roofline_ms(pre_draft_p, hw)
        overlapped = shared * alone / raw
    handover = hw.handover_ms if two_gpus else 0.0
    return Costs(scale.ar * roofline_ms(ar_p, hw), verify,
                 scale.draft * roofline_ms(draft_one_p, hw) + handover, overlapped)


# ---- cycles (pure) ------------------------------------------------------------------------------
def copy_probability(acc: Acceptance, batch: int) -> float:
    """A cycle of copies needs a copy for every row: the batch-1 share to the power of the
    batch (rows taken as independent)."""
    return acc.copy_share ** batch


def tokens_and_ms(acc: Acceptance, c: Costs, batch: int) -> tuple[float, float]:
    """Expected (tokens a row, ms) of one cycle of `acc.mode` at `batch`."""
    pc = copy_probability(acc, batch)
    tokens = pc * acc.copy_tokens + (1 - pc) * acc.draft_tokens
    if acc.mode == "sync":
        return tokens, c.verify + (1 - pc) * c.draft_one
    miss = 1 - acc.hit_rate ** batch  # any row whose branches missed waits for a draft
    return tokens, pc * c.verify + (1 - pc) * (c.overlapped + miss * c.draft_one)


def speedup(acc: Acceptance, c: Costs, batch: int) -> float:
    """Tokens/s of the mode over ar's at the same batch (one token a row per ar step)."""
    tokens, ms = tokens_and_ms(acc, c, batch)
    return (tokens / ms) / (1 / c.ar)


# ---- inputs -------------------------------------------------------------------------------------
def acceptance_rows(run: dict, name: str) -> list[Acceptance]:
    """The fixed sync and async rows of one `d3d bench` file ('sync@8' as it names them)."""
    out = []
    for key, row in run.get("modes", {}).items():
        mode, _, block = key.partition("@")
        if mode not in ("sync", "async"):
            continue
        copy = row.get("by_kind", {}).get("copy", {})
        out.append(Acceptance(
            source=f"{name}:{key}", mode=mode, block=int(block or run.get("block_size") or 16),
            branches=int(run.get("branch_budget") or 1),
            draft_tokens=drafting_tau(row), copy_tokens=copy.get("tokens_per_cycle", 0.0),
            copy_share=copy.get("cycle_share", 0.0), hit_rate=row.get("branch_hit_rate") or 0.0,
        ))
    return out


def load_acceptance(paths: list[Path]) -> list[Acceptance]:
    return [a for p in paths if p.is_file()
            for a in acceptance_rows(json.loads(p.read_text()), p.name)]


def measured_scale(shape_run: dict, s: Shape, hw: Hardware, context: int,
                   block: int, branches: int) -> tuple[Scale, list[tuple[str, float, float]]]:
    """gpu_scale.py's timings of one shape at batch 1 -> (measured over roofline per kind of
    pass, [(pass, roofline ms, measured ms)])."""
    v_ms = float(_nearest(shape_run["verify_ms"], block))
    d_key = min(shape_run["draft_ms"], key=lambda k: abs(float(k) - branches))
    d_ms = float(shape_run["draft_ms"][d_key])
    # gpu_scale.py's drafter pass: k blocks of 16 (gpu_shapes.BLOCK)
    predicted = [
        ("ar step", roofline_ms(forward_pass(s, 1, 1, context), hw), float(shape_run["ar_step_ms"])),
        (f"verify {block}", roofline_ms(forward_pass(s, 1, block, context), hw), v_ms),
        (f"draft {d_key} branches", roofline_ms(forward_pass(s, 1, 16 * int(d_key), context), hw),
         d_ms),
    ]
    scale = Scale(*(m / p for _, p, m in predicted))
    k = min(shape_run.get("cycle", {}), key=lambda c: abs(float(c) - branches), default=None)
    if k is not None:  # gpu_scale.py's async cycle: verify 16 beside a k-branch pre-draft
        both = together(forward_pass(s, 1, 16, context), forward_pass(s, 1, 16 * int(k), context))
        predicted.append((f"async cycle {k} br.", roofline_ms(both, hw),
                          float(shape_run["cycle"][k]["async_cycle_ms"])))
    return scale, predicted


def tokens_within(by_position: list[float], width: int) -> float:
    """Offline accepted length at a verify width: the one token every cycle emits plus the
    chance of each of the width - 1 drafts (`bench_accept.py`'s by_position: P(draft d
    accepted), d = 1 .. B-1, acceptance stopping at the first miss)."""
    return 1.0 + float(sum(by_position[: width - 1]))


def per_position_line(path: Path, block: int) -> str | None:
    """What verifying wider than `block` would add, from an offline per-position trace."""
    if not path.is_file():
        return None
    blocks = json.loads(path.read_text()).get("blocks", {})
    if not blocks:
        return None
    widest = max(blocks, key=int)
    pos = blocks[widest]["by_position"]
    return (f"{path.name} block {widest}, accepted per position: "
            + " ".join(f"{x:.2f}" for x in pos[:8])
            + f" ...; width {block}: {tokens_within(pos, block):.2f} tokens, width {widest}: "
            f"{tokens_within(pos, int(widest)):.2f}, so the projection verifies {block} wide")


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


# ---- the SGLang worker's cycle ------------------------------------------------------------------
SGLANG_RUN = RESULTS / "sglang_cpu.json"  # benchmarks/bench_sglang.py on CPU
LAUNCH_US = 4.0  # assumed host cost of one kernel launch in an eager pass
KERNELS_PER_LAYER = 12  # assumed kernels a decoder layer launches (norms, projections, rope, ...)


def eager_ms(s: Shape, launch_us: float = LAUNCH_US) -> float:
    """What an eager pass adds to its graphed time: every kernel's launch (an assumption)."""
    return s.layers * KERNELS_PER_LAYER * launch_us / 1e3


def worker_acceptance(path: Path) -> list[tuple[str, int, float]]:
    """(dataset, block, tokens a speculative cycle) from bench_sglang.py's CPU run at one
    request at a time: chains drafted by the shared drafter, as the worker verifies them."""
    run = json.loads(path.read_text())
    block = int(run["args"]["block"] or 16)
    out = []
    for ds, by_c in run["results"].items():
        cycle = (by_c.get("1") or {}).get("per_cycle") or {}
        tokens = cycle.get("spec_accepted_length") or spec_tokens(cycle)
        if tokens:
            out.append((ds, block, float(tokens)))
    return out


def spec_tokens(cycle: dict) -> float | None:
    """Tokens a speculative cycle from a one-request run's mix: each cycle is one request, a
    plain one gives one token, so (accepted - plain share) / (1 - plain share)."""
    acc, plain = cycle.get("accepted_length"), cycle.get("plain_share", 0.0)
    if acc is None or plain >= 1:
        return None
    return (acc - plain) / (1 - plain)


def worker_cycles(s: Shape, hw: Hardware, block: int, batch: int, context: int,
                  launch_us: float = LAUNCH_US) -> dict[str, float]:
    """ms of: SGLang alone's step (graphed, eager), the worker's cycle as built (eager draft
    pass + eager verify), and a one-pass cycle (the next block's mask rows for every outcome,
    block x (block - 1), inside a graphed verify)."""
    step = roofline_ms(forward_pass(s, batch, 1, context), hw)
    verify = roofline_ms(forward_pass(s, batch, block, context), hw)
    draft = roofline_ms(forward_pass(s, batch, block, context), hw)
    one_pass = roofline_ms(forward_pass(s, batch, block + block * (block - 1), context), hw)
    eager = eager_ms(s, launch_us)
    return {"step": step, "step_eager": step + eager, "worker": draft + verify + 2 * eager,
            "one_pass": one_pass}


def worker_table(s: Shape, hw: Hardware, rows: list[tuple[str, int, float]], context: int,
                 launch_us: float = LAUNCH_US) -> list[str]:
    lines = [f"SGLang worker, acceptance from {SGLANG_RUN.name} (tokens a speculative cycle at "
             f"one request); eager passes add {eager_ms(s, launch_us):.2f} ms of launches "
             f"({KERNELS_PER_LAYER} kernels a layer x {launch_us:g} us, an assumption). Speedup "
             "over SGLang alone, graphed:"]
    for ds, block, tokens in rows:
        lines.append(f"{ds}: block {block}, {tokens:.2f} tokens a cycle")
        head = (f"{'batch':>5} {'SGLang ms':>10} {'SGLang eager':>13} {'worker (eager, 2 passes)':>25}"
                f" {'one pass (graphed)':>19}")
        lines += [head, "-" * len(head)]
        for b in BATCHES:
            c = worker_cycles(s, hw, block, b, context, launch_us)
            lines.append(f"{b:>5} {c['step']:>10.2f} {c['step'] / c['step_eager']:>12.2f}x "
                         f"{tokens * c['step'] / c['worker']:>24.2f}x "
                         f"{tokens * c['step'] / c['one_pass']:>18.2f}x")
    return lines


# ---- the table ----------------------------------------------------------------------------------
def table(s: Shape, hw: Hardware, rows: list[Acceptance], context: int, scale: Scale) -> list[str]:
    lines = []
    for acc in rows:
        lines.append(f"{acc.source}: drafting cycles {acc.draft_tokens:.2f} tokens, copies "
                     f"{acc.copy_tokens:.2f} tokens in {100 * acc.copy_share:.0f}% of cycles"
                     + (f", branch hit rate {acc.hit_rate:.2f}" if acc.mode == "async" else ""))
    head = f"{'batch':>5} {'ar ms':>7}" + "".join(
        f" {f'{a.mode}@{a.block} {p}':>14}" for a in rows for p in ("(a)", "(b)"))
    lines += [head, "-" * len(head)]
    for b in BATCHES:
        line = f"{b:>5}"
        for i, acc in enumerate(rows):
            ca = costs(s, hw, acc, b, context, two_gpus=False, scale=scale)
            cb = costs(s, hw, acc, b, context, two_gpus=True, scale=scale)
            if i == 0:
                line += f" {ca.ar:>7.2f}"
            line += f" {speedup(acc, ca, b):>13.2f}x {speedup(acc, cb, b):>13.2f}x"
        lines.append(line)
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=512, help="cached tokens a row (gpu_scale's)")
    p.add_argument("--accepted", nargs="*", default=None, help="CPU `d3d bench` JSON files")
    p.add_argument("--measured", default=str(MEASURED), help="gpu_check.sh / gpu_scale.py JSON")
    p.add_argument("--sglang", default=str(SGLANG_RUN), help="bench_sglang.py JSON (CPU run)")
    p.add_argument("--launch-us", type=float, default=LAUNCH_US,
                   help="assumed host cost of a kernel launch in an eager pass")
    return p.parse_args(argv)


def main(argv=None) -> list[str]:
    a = parse_args(argv)
    s, hw = SHAPES[a.shape], H200
    files = [Path(p) for p in a.accepted] if a.accepted else [RESULTS / f for f in SOURCES]
    rows = load_acceptance(files)
    out = [f"PROJECTION (not a measurement): {s.name}, bf16, {hw.name} roofline "
           f"({hw.bandwidth / 1e12:.1f} TB/s, {hw.peak_flops / 1e12:.0f} TFLOP/s), "
           f"{a.context} tokens cached a row, CPU acceptance x GPU cost model.",
           f"weights {weight_bytes(s) / 1e9:.1f} GB a pass, KV {kv_bytes_per_token(s) / 1e3:.0f} KB"
           " a token; (a) drafter on a second stream of the same H200, (b) on a second H200."]
    scale = Scale()
    measured = Path(a.measured)
    run = json.loads(measured.read_text())["shapes"].get(a.shape) if measured.is_file() else None
    if run and rows:
        scale, predicted = measured_scale(run, s, hw, a.context, rows[0].block, rows[0].branches)
        out.append(f"cost model: roofline scaled by {measured.name} (batch 1); roofline error:")
        out += [f"  {name:<20} roofline {p:7.2f} ms, measured {m:7.2f} ms, error "
                f"{error_pct(p, m):+6.1f}%" for name, p, m in predicted]
    else:
        out.append(f"cost model: roofline only ({measured.name} not found: not measured on a GPU)")
    offline = {"bench_fixed_gsm8k30.json": "accept_gsm8k.json",
               "bench_fixed_mt_bench20.json": "accept_mt_bench.json"}
    for f in files:
        line = per_position_line(RESULTS / offline.get(f.name, ""), rows[0].block) if rows else None
        out += [line] if line else []
        out += table(s, hw, [r for r in rows if r.source.startswith(f.name + ":")], a.context, scale)
    sglang = Path(a.sglang)
    if sglang.is_file() and worker_acceptance(sglang):
        out += worker_table(s, hw, worker_acceptance(sglang), a.context, a.launch_us)
    else:
        out.append(f"SGLang worker: {sglang.name} not found (benchmarks/bench_sglang.py writes it)")
    out.append("speedup = tokens/s over ar's at the same batch; a projection, not measured.")
    print("\n".join(out))
    return out


if __name__ == "__main__":
    main()
