"""Bar chart of a bench_peers.py result: tokens/s per engine, time to first token beside it.

    .venv/bin/python benchmarks/plot_peers.py benchmarks/results/peers.json peers.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, out: str) -> None:
    report = json.loads(open(src).read())
    table, args = report["table"], report["args"]
    names = list(table)
    colors = ["tab:orange" if n.startswith("llama") else "tab:blue" if n.startswith("d3d") else "tab:gray"
              for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [table[n]["tokens_per_s"] for n in names], color=colors)
    a.set_ylabel("tokens/s (higher is better)")
    b.bar(names, [table[n]["mean_ttft_ms"] for n in names], color=colors)
    b.set_ylabel("time to first token, ms")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=40)
    fig.suptitle(f"{args['dataset']}, {args['num_prompts']} prompts x {args['max_new_tokens']} tokens, "
                 f"greedy, {args['threads']} CPU threads (llama.cpp: 4-bit GGUF; HF and d3d: fp32)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
