"""Paired ratios between serving modes: each round of a load runs through every mode's server
back to back, so a round's ratio (mode / baseline) sees the same machine state on both sides,
and the spread of those ratios over rounds says how far the figure can be trusted.

Measured why: two servers that both decoded plainly came out 0.93x-1.05x of each other on
single loads of 48 requests (benchmarks/results/README.md), so one load cannot tell a 3% loss
from noise.
"""

from __future__ import annotations

import math
from collections import defaultdict

LOAD_KEY = ("dataset", "concurrency", "variant")
FIGURES = {  # name in the summary -> (row field, the part of it compared)
    "tok_s": ("output_throughput", None),
    "tpot_mean": ("tpot_ms", "mean"),
    "ttft_mean": ("ttft_ms", "mean"),
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
            for name, (field, part) in FIGURES.items():
                ratios = [x / b for k in sorted(rounds) if k in base
                          if (x := _figure(rounds[k], field, part)) and (b := _figure(base[k], field, part))]
                entry[name] = ratio_summary(ratios) if ratios else None
            out.append(entry)
    return out


def _figure(row: dict, field: str, part: str | None) -> float | None:
    value = row.get(field)
    return value.get(part) if part is not None and value is not None else value


def print_paired(entries: list[dict]) -> None:
    print(f"{'mode':6} {'dataset':9} {'conc':>4} {'variant':8} {'rounds':>6} "
          f"{'tok/s ratio [range] +-sem':>28} {'TPOT ratio [range]':>24}")  # fmt: skip
    for e in entries:
        tok, tpot = e["tok_s"], e["tpot_mean"]
        print(f"{e['mode']:6} {e['dataset'][:9]:9} {e['concurrency']:>4} {e['variant']:8} "
              f"{tok['rounds'] if tok else 0:>6} {_cell(tok, True):>28} {_cell(tpot, False):>24}")


def _cell(s: dict | None, with_sem: bool) -> str:
    if s is None:
        return "-"
    text = f"{s['ratio']:.3f} [{s['low']:.3f}, {s['high']:.3f}]"
    if with_sem and s["sem"] is not None:
        text += f" +-{s['sem']:.3f}"
    return text
