"""gpu_scale.py's projection and printed table.

PROJECTION, not a measurement: the accepted lengths and branch hit rates come from `d3d bench`
runs on CPU (SmolLM2-135M target, the project's trained drafter); the pass times come from the
GPU run. Per shape, with tau the mean accepted length (tokens per cycle), h the branch hit rate
and k the branch budget of that CPU run, by the mode of the CPU row:

    async  cycle = h * async_cycle(k) + (1 - h) * (async_cycle(k) + draft(1))
                   (a miss adds a synchronous draft, about one single-branch pass)
    sync   cycle = draft(1) + verify(B)
    fused  cycle = fused(B x 1)  (one pass; a miss's next pass is no longer)
    projection = tau * ar_step / cycle

It assumes the CPU acceptance carries over to each shape's family and size, which it need not.
Where the CPU row splits its cycles by kind (`d3d bench`'s `by_kind`), tau is that of its
drafting cycles alone: its cycles of copies skip the drafter (on GSM8K 78% of them), so their
tokens would be credited to a cycle priced with a draft pass. Copies would add to the
projection; they are left out of it.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SOURCES = (  # CPU runs of the shipped drafter (results/README.md gives their commands)
    "bench_fixed_gsm8k30.json", "bench_fixed_mt_bench20.json",  # sync, async
    "bench_fused_gsm8k30.json",  # fused
)
PROJECTED = ("async", "sync", "fused")  # fixed plans only: an adaptive row mixes plans


def acceptance_sources(paths: list[str] | None) -> list[dict]:
    """The async, sync and fused rows (mode names as `d3d bench` writes them: 'sync@8') of CPU
    `d3d bench` result files; missing files are skipped."""
    files = [Path(p) for p in paths] if paths else [RESULTS / f for f in DEFAULT_SOURCES]
    out = []
    for f in files:
        if not f.is_file():
            continue
        run = json.loads(f.read_text())
        for name, row in run.get("modes", {}).items():
            mode, _, block = name.partition("@")
            if mode not in PROJECTED:
                continue
            out.append(
                {
                    "source": f"{f.name}:{name}",
                    "mode": mode,
                    "block": int(block or run.get("block_size") or 16),
                    "dataset": run.get("dataset"),
                    "drafter": run.get("drafter"),
                    "branch_budget": run.get("branch_budget", 4),
                    "mean_accepted_length": drafting_tau(row),
                    "branch_hit_rate": row.get("branch_hit_rate") or 0.0,
                }
            )
    return out


def drafting_tau(row: dict) -> float:
    """Tokens a cycle of a `d3d bench` mode row: of its drafting cycles where it reports them
    by kind, else of all its cycles (rows from before the split)."""
    draft = row.get("by_kind", {}).get("draft")
    return draft["tokens_per_cycle"] if draft else row["mean_accepted_length"]


def _nearest(d: dict, key):
    """d's value at the key nearest `key` (JSON made the keys strings)."""
    return d[min(d, key=lambda k: abs(float(k) - float(key)))]


def project_cycle(shape: dict, acc: dict) -> tuple[float, int]:
    """-> (the projected cycle in ms, branches it assumes)."""
    mode = acc.get("mode", "async")
    one_branch = shape["draft_ms"][min(shape["draft_ms"], key=float)]
    if mode == "sync":
        return one_branch + _nearest(shape["verify_ms"], acc["block"]), 0
    if mode == "fused":
        ones = {r["block"]: r["ms"] for r in shape["fused"] if r["branches"] == 1}
        return _nearest(ones, acc["block"]), 1
    cycles = shape["cycle"]
    k = min(cycles, key=lambda b: abs(float(b) - acc["branch_budget"]))  # nearest measured budget
    hit = cycles[k]["async_cycle_ms"]
    h = acc["branch_hit_rate"]
    return h * hit + (1 - h) * (hit + one_branch), k


def project(shape: dict, acc: dict) -> dict:
    """One shape's projected speedup over its AR step, from one CPU acceptance source."""
    cycle, k = project_cycle(shape, acc)
    h = acc["branch_hit_rate"]
    return {
        "label": "PROJECTION (CPU acceptance x GPU pass times), not a measured speedup",
        "source": acc["source"],
        "mode": acc.get("mode", "async"),
        "dataset": acc["dataset"],
        "mean_accepted_length": acc["mean_accepted_length"],
        "branch_hit_rate": h,
        "branches": k,
        "projected_cycle_ms": cycle,
        "projected_speedup": acc["mean_accepted_length"] * shape["ar_step_ms"] / cycle,
    }


def projections(shapes: dict, sources: list[dict]) -> dict:
    return {name: [project(s, acc) for acc in sources] for name, s in shapes.items()}


def print_table(result: dict) -> None:
    env = result["environment"]
    print(f"\n{env.get('gpu', env['device'])}, {env['dtype']}, torch {env['torch']}")
    head = (
        f"{'shape':<22}{'AR':>7}{'v4':>7}{'v8':>7}{'v16':>7}{'d1':>7}{'d4':>7}{'d17':>7}"
        f"{'c/max1':>8}{'c/max4':>8}{'c/max17':>8}{'b2b/max4':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for s in result["shapes"].values():
        v, d, c = s["verify_ms"], s["draft_ms"], s["cycle"]
        row = f"{s['shape']['name']:<22}{s['ar_step_ms']:>7.1f}"
        row += "".join(f"{v[b]:>7.1f}" for b in sorted(v))
        row += "".join(f"{d[k]:>7.1f}" for k in sorted(d))
        row += "".join(f"{c[k]['cycle_over_max']:>8.2f}" for k in sorted(c))
        row += f"{_nearest(c, 4)['back_to_back_over_max']:>9.2f}"
        print(row)
        f = s.get("fused", [])
        if f:
            print(f"{'':<22}fused B x k: " + "  ".join(
                f"{r['block']}x{r['branches']} {r['ms']:.1f}" for r in f))
    print("ms; v = target verify at block B, d = drafter pass with k branches, c/max = async")
    print("cycle / max(draft, verify) at block 16 (1.0 = full overlap), b2b = back to back.")
    for name, rows in result["projection"].items():
        for p in rows:
            print(
                f"PROJECTION {name} {p.get('mode', 'async')}: {p['projected_speedup']:.2f}x over AR "
                f"(tau {p['mean_accepted_length']:.2f}, hit rate {p['branch_hit_rate']:.2f}, "
                f"from {p['source']}; not measured)"
            )
