"""The training comparisons of `recipes/compare_formats.sh`: KL against CE, the
rank-32 delta format against full-rank deltas (a full fine-tune of the mask path), and which
slots enter the loss (by position, or by the target's confidence in the earlier drafts), each
arm trained the same number of steps over the same schedule and data, evaluated on the same
held-out blocks. Prints a markdown table and writes it (and the JSON behind it).

    .venv/bin/python benchmarks/compare_formats.py --runs runs/compare \
        --out benchmarks/results/compare_formats
    .venv/bin/python benchmarks/compare_formats.py --runs runs/compare \
        --arms weights_position,weights_confidence --out benchmarks/results/compare_weights
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ARMS = {"kl": "rank 32, KL to the target", "ce": "rank 32, CE on greedy tokens",
        "full": "full rank (576), KL to the target",
        "weights_position": "rank 32, KL, draft d in the loss w.p. exp(-(d-1)/7) (default)",
        "weights_confidence": "rank 32, KL, slots in the loss w.p. the target's confidence "
                              "in the block's earlier drafts"}


def arm_summary(history: list[dict]) -> dict:
    """The last evaluation row and the training speed before it."""
    evals = [r for r in history if "accept_len" in r]
    steps = [r for r in history if "loss" in r]
    last = evals[-1]
    done = [r for r in steps if r["step"] <= last["step"]]
    per_step = done[-1]["elapsed_s"] / done[-1]["step"] if done else float("nan")
    return {"step": last["step"], "accept_len": last["accept_len"],
            "accept_len_b4": last.get("accept_len_b4"), "by_position": last["by_position"][:4],
            "start_accept_len": evals[0]["accept_len"], "seconds_per_step": per_step}


def checkpoint_mb(drafter_dir: Path) -> float:
    files = list(drafter_dir.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 1e6


def table(rows: dict[str, dict]) -> str:
    lines = ["| arm | steps | accept len (block 16) | block 4 | P(d2) | P(d3) | wall s/step (shared, paused) | "
             "checkpoint MB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        p = r["by_position"]
        lines.append(f"| {ARMS.get(name, name)} | {r['step']} | {r['accept_len']:.3f} | "
                     f"{r['accept_len_b4']:.3f} | {p[1]:.3f} | {p[2]:.3f} | "
                     f"{r['seconds_per_step']:.1f} | {r['checkpoint_mb']:.1f} |")
    start = next(iter(rows.values()))["start_accept_len"]
    lines += ["", f"Untrained (step 0, every arm): accept len {start:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/compare")
    p.add_argument("--out", default="benchmarks/results/compare_formats")
    p.add_argument("--arms", default="kl,ce,full", help="comma-separated arm folders")
    a = p.parse_args(argv)
    rows = {}
    for name in a.arms.split(","):
        d = Path(a.runs) / name
        if not (d / "history.jsonl").exists():
            continue
        hist = [json.loads(x) for x in (d / "history.jsonl").read_text().splitlines() if x]
        rows[name] = arm_summary(hist) | {"checkpoint_mb": checkpoint_mb(d / "drafter")}
    md = table(rows)
    print(md)
    Path(a.out + ".md").write_text(md)
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
