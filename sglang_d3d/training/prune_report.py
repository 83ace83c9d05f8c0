"""The pruning table (JSON + markdown) and its plot (PNG)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def pick_depth(rows: list[dict]) -> dict:
    """Fastest end to end (a row's tokens_per_s: its better speculative mode) when measured;
    otherwise the shallowest depth that keeps >= 99% of
    the full drafter's acceptance length (a proxy, stated as such in the report)."""
    if all(not math.isnan(r.get("tokens_per_s", float("nan"))) for r in rows):
        best = max(rows, key=lambda r: r["tokens_per_s"])
        return {"depth": best["depth"], "rule": "highest end-to-end tokens/s (the better of sync and async)"}
    full = rows[0]["accept_len"]
    ok = [r for r in rows if r["accept_len"] >= 0.99 * full]
    best = min(ok, key=lambda r: r["depth"])
    return {"depth": best["depth"], "rule": "shallowest depth with >= 99% of full accept_len "
            "(no end-to-end measurement)"}


def markdown(rows: list[dict], choice: dict, num_held: int) -> str:
    has_e2e = "tokens_per_s" in rows[0]
    modes = [m for m in ("sync", "async", "ar") if f"{m}_tokens_per_s" in rows[0]]
    head = "| depth | layers (target ids) | removed | accept len | draft ms / branch batch |"
    head += "".join(f" {m} tok/s |" for m in modes) if modes else (" tok/s |" if has_e2e else "")
    lines = [head, "|" + "---|" * (5 + (len(modes) or int(has_e2e)))]
    for r in rows:
        line = (f"| {r['depth']} | {r['source_layers']} | {r['removed_source_layers']} | "
                f"{r['accept_len']:.3f} | {1000 * r['draft_s_per_branch_batch']:.1f} |")
        if modes:
            line += "".join(f" {r[f'{m}_tokens_per_s']:.1f} |" for m in modes)
        elif has_e2e:
            line += f" {r['tokens_per_s']:.1f} |"
        lines.append(line)
    lines += ["", f"Held-out samples: {num_held}. Chosen depth: {choice['depth']} "
              f"({choice['rule']})."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = [r["depth"] for r in rows]
    modes = [m for m in ("sync", "async", "ar") if f"{m}_tokens_per_s" in rows[0]]
    fig, axes = plt.subplots(2 if modes else 1, 1, figsize=(6, 6.5 if modes else 4),
                             squeeze=False, sharex=True)
    ax = axes[0][0]
    ax.plot(depth, [r["accept_len"] for r in rows], "o-", color="tab:blue")
    ax.set_ylabel("held-out accept length", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(depth, [1000 * r["draft_s_per_branch_batch"] for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("draft ms per branch batch", color="tab:red")
    ax.set_title("D3D progressive layer pruning")
    if modes:
        bottom = axes[1][0]
        for m in modes:
            bottom.plot(depth, [r[f"{m}_tokens_per_s"] for r in rows], "o-", label=m)
        bottom.set_ylabel("end-to-end tokens/s")
        bottom.legend()
    axes[-1][0].set_xlabel("drafter layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[dict], out: Path, config: dict, num_held: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    choice = pick_depth(rows)
    (out / "prune_table.json").write_text(json.dumps(
        {"rows": rows, "choice": choice, "config": config, "num_heldout": num_held}, indent=2))
    (out / "prune_table.md").write_text(markdown(rows, choice, num_held))
    plot(rows, out / "prune_plot.png")
    return choice
