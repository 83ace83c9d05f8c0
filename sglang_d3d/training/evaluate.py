"""Offline greedy acceptance length on held-out distillation samples.

A greedy datagen response is the target's own greedy continuation, so at any anchor a the target
would accept draft j exactly when it equals x_{a+j}. Drafting one block at anchor a and counting
the leading drafts (slots 1..B-1) that match, plus one for the target's own token, gives the
accepted length of that verify cycle without running the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.training.objective import build_example, collate
from sglang_d3d.training.shards import Sample


@dataclass(frozen=True)
class AcceptanceResult:
    mean: float  # mean accepted length per verify (bonus/correction token included)
    by_source: dict[int, float]
    num_blocks: int


def accepted_lengths(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """drafts, truth: [M, B-1] -> [M] leading matches + 1."""
    match = (drafts == truth).long()
    return match.cumprod(-1).sum(-1) + 1


def eval_anchors(sample: Sample, block: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors whose B-1 draft slots all fall inside the response."""
    p, t = len(sample.prompt), len(sample.ids)
    lo, hi = p - 1, t - block  # slot B-1 at a + B - 1 <= t - 1
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(hi - lo + 1, generator=gen)[:num] + lo
    return torch.sort(pick).values


@torch.no_grad()
def block_drafts(drafter, sample: Sample, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[K, B-1] greedy drafts of slots 1..B-1 for each anchor (one packed pass)."""
    ids = torch.from_numpy(sample.ids).long()
    b = collate([build_example(ids, anchors, block)])
    h = drafter.hidden(b["input_ids"], b["positions"], b["mask"])  # [1, L, H]
    slots = h[0, ids.numel() :].view(anchors.numel(), block, -1)[:, : block - 1]  # [K, B-1, H]
    return drafter.logits(slots).argmax(-1)


def acceptance_length(
    drafter, samples: list[Sample], block: int, anchors_per_sample: int = 8, seed: int = 0
) -> AcceptanceResult:
    gen = torch.Generator().manual_seed(seed)  # same anchors for every checkpoint
    lengths, sources = [], []
    for s in samples:
        anchors = eval_anchors(s, block, anchors_per_sample, gen)
        if anchors.numel() == 0:
            continue
        ids = torch.from_numpy(s.ids).long()
        truth = ids[anchors.unsqueeze(1) + torch.arange(1, block)]  # [K, B-1]
        lengths.append(accepted_lengths(block_drafts(drafter, s, anchors, block), truth))
        sources += [s.source] * anchors.numel()
    if not lengths:
        return AcceptanceResult(float("nan"), {}, 0)
    all_len = torch.cat(lengths).float()
    src = torch.tensor(sources)
    by = {int(k): float(all_len[src == k].mean()) for k in src.unique()}
    return AcceptanceResult(float(all_len.mean()), by, int(all_len.numel()))
