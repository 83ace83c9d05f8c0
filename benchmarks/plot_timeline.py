"""Plot an async per-cycle timeline (from `d3d bench --timeline FILE`) as a Gantt chart, so that
overlap between drafter and target can be seen rather than assumed.

    python benchmarks/plot_timeline.py runs/timeline.json benchmarks/results/timeline.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(cycles: list[dict], out: str, first: int = 12) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.2))
    t = 0.0
    for c in cycles[:first]:
        bars = [
            ("target verify", c["verify_start"], c["verify_end"], 1.0, "tab:blue"),
            ("drafter: sync draft", 0.0, c["draft_end"], 0.0, "tab:red"),
            ("drafter: pre-draft branches", c["predraft_start"], c["predraft_end"], 0.0, "tab:green"),
        ]
        for label, a, b, y, color in bars:
            if b > a:
                ax.broken_barh([(1e3 * (t + a), 1e3 * (b - a))], (y, 0.8), color=color, label=label)
        ax.axvline(1e3 * (t + c["end"]), color="grey", lw=0.5)
        t += c["end"]
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_yticks([0.4, 1.4], ["drafter", "target"])
    ax.set_xlabel("ms (grey lines: cycle ends)")
    hits = sum(c["hits"] for c in cycles)
    total = hits + sum(c["misses"] for c in cycles)
    ov = sum(c["overlap"] for c in cycles) / max(1e-9, sum(c["end"] for c in cycles))
    ax.set_title(f"async D3D timeline, first {first} cycles; over all {len(cycles)} cycles: "
                 f"overlap fraction {ov:.2f}, branch hits {hits}/{total}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    plot(json.load(open(sys.argv[1])), sys.argv[2])
