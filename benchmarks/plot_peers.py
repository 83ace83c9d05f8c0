"""Bar chart of a bench_peers.py result: tokens/s per engine, grouped by dataset.

    .venv/bin/python benchmarks/plot_peers.py benchmarks/results/peers.json peers.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def color(name: str) -> str:
    if name.startswith("llama"):
        return "tab:orange"
    return "tab:blue" if name.startswith("d3d") else "tab:gray"


def main(src: str, out: str) -> None:
    report = json.loads(open(src).read())
    datasets, args = report["datasets"], report["args"]
    names = list(next(iter(datasets.values()))["table"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4.2), sharey=True)
    axes = axes if len(datasets) > 1 else [axes]
    for ax, (ds, d) in zip(axes, datasets.items()):
        ax.bar(names, [d["table"][n]["tokens_per_s"] for n in names], color=[color(n) for n in names])
        ax.set_title(ds)
        ax.tick_params(axis="x", rotation=60)
    axes[0].set_ylabel("tokens/s (higher is better)")
    fig.suptitle(f"{args['num_prompts']} prompts x {args['max_new_tokens']} tokens, greedy, "
                 f"{args['threads']} CPU threads, batch 1 (llama and d3d: 4-bit weights; "
                 f"d3d-fp32, llama-f32 and hf: fp32)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
