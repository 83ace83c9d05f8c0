"""What the drafter's int8 passes cost in drafts accepted, by quantisation setting.

Drafts blocks at anchors of the target's own greedy answers to evaluation prompts (the
responses `bench_accept.py` caches), the way the engine does: the prefix's keys and values
are the target's (a full-depth drafter adopts them), and only the anchor and its mask block
run through the drafter's weights. Counts the leading drafts equal to the target's own
continuation. Settings, side by side on the same blocks:
    full   fp32 weights (the reference)
    w7a8   7-bit weights, 8-bit activations (shipped where fbgemm sums pairs in int16: AVX2)
    w8a7   8-bit weights, 7-bit activations (reduce_range: no int16 overflow anywhere)
    w8a8   8-bit weights, 8-bit activations (shipped where it sums in int32: AVX-512 VNNI;
           elsewhere its sums saturate)

    .venv/bin/python benchmarks/bench_int8_accuracy.py --dataset gsm8k --num-prompts 30 \
        --out benchmarks/results/int8_accuracy_gsm8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_accept import add_sample_args, load_pair
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.int8_linear import Int8Setting
from sglang_d3d.models.loading import resolve_drafter_path
from sglang_d3d.models.packing import extend_pack

SETTINGS = {"full": None, "w7a8": Int8Setting(63), "w8a7": Int8Setting(127, reduce_range=True),
            "w8a8": Int8Setting(127)}  # fmt: skip


def blocks(samples, anchors: int, block: int, seed: int = 0):
    """(context, anchor token, the target's next block-1 tokens) at random response anchors."""
    rng = np.random.default_rng(seed)
    out = []
    for s in samples:
        seq, p = np.concatenate([s.prompt, s.response]).tolist(), len(s.prompt)
        last = len(seq) - block
        if last <= p:
            continue
        for a in sorted(rng.choice(np.arange(p, last), min(anchors, last - p), replace=False)):
            out.append((seq[:a], seq[a], seq[a + 1 : a + block]))
    return out


def accepted(logits: torch.Tensor, truth: list[int]) -> int:
    """Leading drafts (logits [B, V]: slot j drafts the token j+1 after the anchor) that match."""
    pred = logits.argmax(-1).tolist()
    n = 0
    while n < len(truth) and pred[n] == truth[n]:
        n += 1
    return n


def score(drafter, setting, cases, block: int) -> dict:
    reference = DraftRunner(drafter, 1, 4096)  # fp32: computes the prefix cache (the target's)
    runner = reference
    if setting is not None:
        drafter.use_int8_setting(setting)
        runner = DraftRunner(drafter, 1, 4096, int8=True)
    n, first = [], []
    for ctx, anchor, truth in cases:
        reference.reset(0)
        reference.prefill(0, ctx)
        if runner is not reference:
            runner.reset(0)
            runner.adopt(0, reference.cache, len(ctx))
        logits = runner.run([(0, extend_pack([anchor], block))])[0][0]  # [B, V]
        n.append(accepted(logits, truth))
        first.append(n[-1] > 0)
    return {"drafts_accepted": float(np.mean(n)), "draft1_right": float(np.mean(first)),
            "blocks": len(cases)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=None)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--settings", default="full,w7a8,w8a7,w8a8")
    add_sample_args(p, anchors=10, threads=2)
    a = p.parse_args()
    drafter, samples = load_pair(a, resolve_drafter_path(a.drafter))
    cases = blocks(samples, a.anchors, a.block)
    report = {s: score(drafter, SETTINGS[s], cases, a.block) for s in a.settings.split(",")}
    for s, r in report.items():
        print(f"{s:5s} drafts accepted {r['drafts_accepted']:.3f}  draft 1 right "
              f"{r['draft1_right']:.3f}  ({r['blocks']} blocks)")
    if a.out:
        Path(a.out).write_text(json.dumps({"dataset": a.dataset, "block": a.block,
                                           "settings": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
