"""Paired ratios between serving modes: each round of a load runs through every mode's server
back to back, so a round's ratio (mode / baseline) sees the same machine state on both sides,
and the spread of those ratios over rounds says how far the figure can be trusted.

Measured why: two servers that both decoded plainly came out 0.93x-1.05x of each other on
single loads of 48 requests, so one load cannot tell a 3% loss from noise.

Each round also compares the two servers' plain steps (the mean time of their cycles of plan
1, which both run): where a mode decodes plainly most of the time, a ratio far from 1 there is
the machine's or the process's speed, not the mode's doing. `tok_s_equal_plain` is the tok/s
ratio scaled by that plain-step ratio, round by round: what the mode would have made at the
base's speed (measured: one server's plain steps at 125 ms against the other's 116 in the
same round, with 1 speculative cycle in 61). It is derived, not measured, and
assumes the plain steps differ by speed alone. The plain steps compared are those at the
load's batch-size bucket where the server labels them; files from servers that did not
label them mix every batch size, which the two modes' plain cycles need not share.

Reprints the paired table of a saved run:

    .venv/bin/python benchmarks/paired.py benchmarks/results/serving_c1c4c16.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from sglang_d3d.engine.adaptive import bucket

LOAD_KEY = ("dataset", "concurrency", "variant")
MIN_PLAIN_CYCLES = 10  # fewer say nothing of a server's speed (one cycle can carry a spike)


def plain_step_ms(row: dict) -> float | None:
    """The mean of the server's plain cycles in ms: at the load's batch-size bucket where the
    server labels its plans by bucket (a plain step at 1 row costs less than at 4, and the
    modes need not spend their plain cycles at the same sizes), else over all sizes; None
    where there are fewer than MIN_PLAIN_CYCLES (a mode that speculated throughout)."""
    if "plans_by_batch" in row:
        plans = row["plans_by_batch"].get(str(bucket(row.get("concurrency", 1))), {})
    else:
        plans = row.get("plans", {})
    cell = plans.get("1")
    return cell["mean_ms"] if cell and cell["cycles"] >= MIN_PLAIN_CYCLES else None


def _part(field: str, part: str):
    return lambda row: (row.get(field) or {}).get(part)


FIGURES = {  # name in the summary -> the row's figure compared
    "tok_s": lambda row: row.get("output_throughput"),
    "tpot_mean": _part("tpot_ms", "mean"),
    "ttft_mean": _part("ttft_ms", "mean"),
    "plain_step": plain_step_ms,
}


def ratio_summary(ratios: list[float]) -> dict:
    """Geometric mean of per-round ratios, their range, and the standard error of the mean
    as a share of it (from the logs' spread; None for one round)."""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    sem = None
    if len(logs) > 1:
        var = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
        sem = math.sqrt(var / len(logs))
    return {"ratio": math.exp(mean), "low": min(ratios), "high": max(ratios), "sem": sem,
            "rounds": len(ratios)}  # fmt: skip


def paired_ratios(rows: list[dict], base_mode: str) -> list[dict]:
    """For every other mode and load: each figure's ratio to `base_mode`'s in the same round
    (`ratio_summary`). Rounds where either side lacks the figure are left out."""
    by_load: dict[tuple, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by_load[tuple(r[k] for k in LOAD_KEY)][r["mode"]][r.get("round", 0)] = r
    out = []
    for load, modes in by_load.items():
        base = modes.get(base_mode, {})
        for mode, rounds in modes.items():
            if mode == base_mode:
                continue
            entry = dict(zip(LOAD_KEY, load)) | {"mode": mode, "base": base_mode}
            per_round = {name: _round_ratios(rounds, base, figure) for name, figure in FIGURES.items()}
            per_round["tok_s_equal_plain"] = {
                k: t * per_round["plain_step"][k] for k, t in per_round["tok_s"].items()
                if k in per_round["plain_step"]}
            for name, ratios in per_round.items():
                entry[name] = ratio_summary(list(ratios.values())) if ratios else None
            out.append(entry)
    return out


def _round_ratios(rounds: dict[int, dict], base: dict[int, dict], figure) -> dict[int, float]:
    """round -> the figure's ratio to the base's in that round, where both have it."""
    return {k: x / b for k in sorted(rounds) if k in base
            if (x := figure(rounds[k])) and (b := figure(base[k]))}


def print_paired(entries: list[dict]) -> None:
    print(f"{'mode':6} {'dataset':9} {'conc':>4} {'variant':8} {'rounds':>6} "
          f"{'tok/s ratio [range] +-sem':>28} {'TPOT ratio [range]':>24} "
          f"{'plain step ratio':>24} {'tok/s at equal plain step':>28}")  # fmt: skip
    for e in entries:
        tok, tpot = e["tok_s"], e["tpot_mean"]
        print(f"{e['mode']:6} {e['dataset'][:9]:9} {e['concurrency']:>4} {e['variant']:8} "
              f"{tok['rounds'] if tok else 0:>6} {_cell(tok, True):>28} {_cell(tpot, False):>24} "
              f"{_cell(e.get('plain_step'), False):>24} {_cell(e.get('tok_s_equal_plain'), True):>28}")


def _cell(s: dict | None, with_sem: bool) -> str:
    if s is None:
        return "-"
    text = f"{s['ratio']:.3f} [{s['low']:.3f}, {s['high']:.3f}]"
    if with_sem and s["sem"] is not None:
        text += f" +-{s['sem']:.3f}"
    return text


def main() -> None:
    """Reprint the paired table of a saved `d3d bench-serving --out` file (older files gain
    the columns added since)."""
    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--base", default="ar", help="the mode compared against (default: ar)")
    a = p.parse_args()
    rows = json.loads(open(a.file).read())["results"]
    if a.base not in {r["mode"] for r in rows}:
        p.error(f"no mode {a.base!r} in {a.file}")
    print_paired(paired_ratios(rows, a.base))


if __name__ == "__main__":
    main()
