"""Offline: accepted length of token trees against chains, on the target's greedy answers.

For blocks at random anchors of the target's own answers, the drafter (as the engine runs it)
drafts one block; the rank of the target's true token in each slot's distribution is recorded.
A slot's distribution does not depend on the guesses at the slots before it (the drafter's
mask slots see the prefix only), so a tree's accepted length is known from the ranks alone.
Two kinds of tree are scored, each on held-out blocks:
  static: the `nodes` rank paths most often right on the other half of the blocks;
  drafter: `build_tree` on each block's own distributions, as the engine builds it;
  and with --lookup L, the drafter's tree with up to L prompt-lookup guesses grafted under its
  first draft (speculative/lookup.py), as the engine builds a greedy row's tree.

    .venv/bin/python benchmarks/bench_tree_offline.py --dataset gsm8k --num-prompts 30 --block 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_accept import add_sample_args, load_pair
from benchmarks.bench_int8_accuracy import blocks
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.loading import resolve_drafter_path
from sglang_d3d.models.packing import extend_pack
from sglang_d3d.speculative.lookup import lookup_continuation
from sglang_d3d.speculative.tree import build_tree, graft, greedy_tree_accept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=None)
    p.add_argument("--block", type=int, default=4, help="drafter slots: block - 1 draft depths")
    p.add_argument("--nodes", default="3,5,7,9,11")
    p.add_argument("--lookup", default="0", help="comma-separated lookup lengths to score")
    add_sample_args(p, anchors=10, threads=2)
    a = p.parse_args()
    drafter, samples = load_pair(a, resolve_drafter_path(a.drafter))
    lookups = [int(n) for n in a.lookup.split(",")]
    # the truth must reach as deep as a grafted lookup run can
    cases = blocks(samples, a.anchors, a.block + 1 + max(lookups))
    ranks, trees = draft_blocks(drafter, cases, a.block)
    nodes = [int(n) for n in a.nodes.split(",")]
    table = score(ranks, trees, nodes, a.block - 1, lookups)
    print(f"{len(ranks)} blocks; share with the target's token in the drafter's top 1 / 2 / 3:")
    for d, row in enumerate(coverage(ranks, 3), start=1):
        print(f"  draft {d}: " + " / ".join(f"{c:.2f}" for c in row))
    print(f"{a.block - 1} draft depths; accepted tokens per cycle (drafts + 1):")
    for row in table:
        print(f"nodes {row['nodes']:2d}: chain {row['chain']:.3f}  static tree {row['static']:.3f}"
              f"  drafter's tree {row['drafter']:.3f}" + "".join(
                  f"  +lookup {k} {v:.3f} ({row['lookup_nodes'][k]:.1f} nodes)"
                  for k, v in row["lookup"].items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"blocks": len(ranks), "block": a.block,
                                           "table": table}, indent=2) + "\n")


def draft_blocks(drafter, cases, block: int):
    """-> (ranks [n, block-1] of the true token per slot, per block (q [block-1, V], the
    true continuation, the context up to the anchor))."""
    ref = DraftRunner(drafter, 1, 4096)
    run = DraftRunner(drafter, 1, 4096, int8=True)
    ranks, probs = [], []
    for ctx, anchor, truth in cases:
        ref.reset(0)
        ref.prefill(0, ctx)
        run.reset(0)
        run.adopt(0, ref.cache, len(ctx))
        lg = run.run([(0, extend_pack([anchor], block))])[0][0][: block - 1].float()  # [D, V]
        t = torch.tensor(truth[: block - 1])
        ranks.append((lg > lg.gather(1, t[:, None])).sum(1).tolist())
        probs.append((torch.softmax(lg, -1), truth, [*ctx, anchor]))
    return np.array(ranks), probs


def coverage(ranks: np.ndarray, k: int) -> list[list[float]]:
    """[depth][j]: share of blocks whose true token is among the drafter's top j + 1 there."""
    return [[float((ranks[:, d] <= j).mean()) for j in range(k)] for d in range(ranks.shape[1])]


def score(ranks: np.ndarray, drafted, nodes: list[int], depth: int,
          lookups: list[int]) -> list[dict]:
    rng = np.random.default_rng(0)
    order = rng.permutation(len(ranks))
    fit, test = ranks[order[::2]], ranks[order[1::2]]
    held = [drafted[i] for i in order[1::2]]
    rows = []
    for n in nodes:
        chain = {tuple([0] * (k + 1)) for k in range(min(n, depth))}
        rows.append({
            "nodes": n,
            "chain": accepted(test, chain),
            "static": accepted(test, static_tree(fit, n, depth)),
            "drafter": float(np.mean([drafter_tree(q, truth, n)[0] for q, truth, _ in held])) + 1,
        })
        runs = {k: [drafter_tree(q, truth, n, k, ctx) for q, truth, ctx in held]
                for k in lookups if k > 0}
        rows[-1]["lookup"] = {k: float(np.mean([a for a, _ in r])) + 1 for k, r in runs.items()}
        rows[-1]["lookup_nodes"] = {k: float(np.mean([m for _, m in r])) for k, r in runs.items()}
    return rows


def static_tree(ranks: np.ndarray, nodes: int, depth: int) -> set[tuple[int, ...]]:
    """The `nodes` rank paths (prefix-closed) most often right."""
    def right(path):
        return np.all(ranks[:, : len(path)] == np.array(path), axis=1).mean()

    tree, frontier = set(), [(r,) for r in range(8)]
    while len(tree) < nodes and frontier:
        best = max(frontier, key=right)
        tree.add(best)
        frontier.remove(best)
        if len(best) < depth:
            frontier += [best + (r,) for r in range(8)]
    return tree


def accepted(ranks: np.ndarray, tree: set[tuple[int, ...]]) -> float:
    """Mean tokens per cycle: drafts accepted along the tree, plus the target's own."""
    out = []
    for r in ranks:
        d = 0
        while d < len(r) and tuple(r[: d + 1]) in tree:
            d += 1
        out.append(d + 1)
    return float(np.mean(out))


def drafter_tree(q: torch.Tensor, truth: list[int], nodes: int, lookup: int = 0,
                 context: list[int] | None = None) -> tuple[int, int]:
    """(drafts accepted by the engine's tree on this block, its size): the target's argmax is
    the truth along the true path, and the accepted path can only follow it. With `lookup`,
    the greedy row's tree as `Drafting.trees` builds it for a batch of one."""
    tree = build_tree(q, nodes)
    if lookup:
        chain = lookup_continuation([*context, tree.tokens[0]], lookup)
        if chain:
            tree = graft(build_tree(q, nodes + lookup), chain, nodes + lookup)
    # argmax after each node: the truth where the node is on the true path, else unused
    argmax = [truth[0]]
    for i in range(tree.size):
        argmax.append(truth[tree.depths[i]] if tree.depths[i] < len(truth) else -1)
    path, _ = greedy_tree_accept(tree, argmax)
    return len(path), tree.size


if __name__ == "__main__":
    main()
