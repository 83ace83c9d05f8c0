"""Offline greedy acceptance length on held-out distillation samples, per block position.

A greedy datagen response is the target's own greedy continuation, so at any anchor a the target
would accept draft d exactly when it equals x_{a+d}. One block at anchor a gives draft 1 from
the anchor's clean output and drafts 2 .. B-1 from the mask slots (the engine's layout);
counting the leading drafts that match, plus one for the target's own token, gives the accepted
length of that verify cycle without running the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.training.forward import block_hidden, clean_pass, pick_rows
from sglang_d3d.training.objective import build_example, collate
from sglang_d3d.training.shards import Sample


@dataclass(frozen=True)
class AcceptanceResult:
    mean: float  # mean accepted length per verify (bonus/correction token included)
    by_source: dict[int, float]
    by_position: list[float]  # [B-1] P(draft d accepted), d = 1 .. B-1
    num_blocks: int


def accepted_lengths(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """drafts, truth: [M, B-1] -> [M] leading matches + 1."""
    match = (drafts == truth).long()
    return match.cumprod(-1).sum(-1) + 1


def eval_anchors(sample: Sample, block: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors whose B-1 drafts all fall inside the response (a + B - 1 <= T - 1)."""
    p, t = len(sample.prompt), len(sample.ids)
    lo, hi = p - 1, t - block
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(hi - lo + 1, generator=gen)[:num] + lo
    return torch.sort(pick).values


@torch.no_grad()
def block_drafts(drafter, samples: list[Sample], anchors: list[torch.Tensor], block: int):
    """-> [sum K, B-1] greedy drafts 1 .. B-1 for every anchor of every sample (one batch)."""
    exs = [build_example(torch.from_numpy(s.ids).long(), a, block) for s, a in zip(samples, anchors)]
    dev = drafter.mask_embedding.device  # the batch is built on the CPU: move it to the drafter
    batch = {k: v.to(dev) for k, v in collate(exs).items()}
    past, clean_h = clean_pass(drafter, batch)
    slot_h = block_hidden(drafter, batch, past)  # [N, KM, H]
    k = torch.tensor([a.numel() for a in anchors])
    anchor_idx = torch.nn.utils.rnn.pad_sequence(anchors, batch_first=True)  # [N, Kmax]
    has = torch.arange(anchor_idx.shape[1]).unsqueeze(0) < k.unsqueeze(1)
    d1 = drafter.logits(pick_rows(clean_h, anchor_idx.to(dev), has.to(dev))).argmax(-1).cpu()
    rest = drafter.logits(slot_h).argmax(-1).cpu()  # [N, KM]
    later = [rest[i, : a.numel() * (block - 1)].view(a.numel(), block - 1)[:, : block - 2]
             for i, a in enumerate(anchors)]
    return torch.cat([d1.unsqueeze(1), torch.cat(later)], 1)  # on the CPU


def acceptance_length(
    drafter, samples: list[Sample], block: int, anchors_per_sample: int = 8, seed: int = 0,
    batch_size: int = 4,
) -> AcceptanceResult:
    gen = torch.Generator().manual_seed(seed)  # same anchors for every checkpoint
    picked = [(s, eval_anchors(s, block, anchors_per_sample, gen)) for s in samples]
    picked = [(s, a) for s, a in picked if a.numel()]
    if not picked:
        return AcceptanceResult(float("nan"), {}, [], 0)
    lengths, matches, sources = [], [], []
    for i in range(0, len(picked), batch_size):
        part = picked[i : i + batch_size]
        drafts = block_drafts(drafter, [s for s, _ in part], [a for _, a in part], block)
        truth = torch.cat([torch.from_numpy(s.ids).long()[a.unsqueeze(1) + torch.arange(1, block)]
                           for s, a in part])  # [K, B-1]
        lengths.append(accepted_lengths(drafts, truth))
        matches.append((drafts == truth).long().cumprod(-1))
        sources += [s.source for s, a in part for _ in range(a.numel())]
    all_len = torch.cat(lengths).float()
    src = torch.tensor(sources)
    by = {int(k): float(all_len[src == k].mean()) for k in src.unique()}
    pos = torch.cat(matches).float().mean(0).tolist()
    return AcceptanceResult(float(all_len.mean()), by, pos, int(all_len.numel()))
