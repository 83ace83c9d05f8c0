"""Losses over drafter hidden states of a collated batch (training/objective.py).

The LM head is the expensive part (49k x 576 on SmolLM2), so logits are computed only at the
rows that carry a label, never over the whole packed row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_d3d.training.objective import IGNORE

HeadFn = Callable[[torch.Tensor], torch.Tensor]  # [M, H] -> [M, K]


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor  # scalar, what is optimised
    block: torch.Tensor  # weighted block cross-entropy
    ar: torch.Tensor  # auxiliary next-token cross-entropy
    slot_acc: torch.Tensor  # [B] top-1 accuracy per block slot (no grad)


def map_labels(labels: torch.Tensor, label_map: torch.Tensor | None) -> torch.Tensor:
    """Token ids -> head indices (restricted head); tokens outside the head become IGNORE."""
    if label_map is None:
        return labels
    out = label_map[labels.clamp(min=0)]
    return torch.where(labels == IGNORE, IGNORE, out)


def block_loss(
    hidden: torch.Tensor,  # [N, L, H]
    labels: torch.Tensor,  # [N, L] head indices or IGNORE
    block_pos: torch.Tensor,  # [N, L] 1..B on mask slots
    weights: torch.Tensor,  # [B]
    head: HeadFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean cross-entropy over labelled mask slots, and per-slot accuracy [B]."""
    sel = labels != IGNORE
    y, slot = labels[sel], block_pos[sel] - 1  # [M]
    logits = head(hidden[sel]).float()  # [M, K]
    ce = F.cross_entropy(logits, y, reduction="none")
    w = weights.to(ce.device)[slot]
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == y).float()
        nb = weights.numel()
        acc = torch.zeros(nb).index_add_(0, slot, hit) / torch.bincount(slot, minlength=nb).clamp(min=1)
    return loss, acc


def ar_loss(hidden: torch.Tensor, ar_labels: torch.Tensor, head: HeadFn) -> torch.Tensor:
    """Mean next-token cross-entropy at the clean positions that carry an AR label."""
    sel = ar_labels != IGNORE
    if not bool(sel.any()):
        return hidden.sum() * 0.0  # keeps the graph valid when nothing is labelled
    return F.cross_entropy(head(hidden[sel]).float(), ar_labels[sel])


def d3d_loss(
    hidden: torch.Tensor,  # [N, L, H]
    batch: dict[str, torch.Tensor],
    weights: torch.Tensor,  # [B]
    head: HeadFn,
    ar_weight: float,
    label_map: torch.Tensor | None = None,  # [V] head index per token id, IGNORE if absent
) -> LossParts:
    labels = map_labels(batch["labels"], label_map)
    blk, acc = block_loss(hidden, labels, batch["block_pos"], weights, head)
    ar = ar_loss(hidden, map_labels(batch["ar_labels"], label_map), head) if ar_weight > 0 else blk * 0
    return LossParts(total=blk + ar_weight * ar, block=blk, ar=ar, slot_acc=acc)


def distill_loss(
    hidden: torch.Tensor,  # [N, L, H] student
    teacher_logits: torch.Tensor,  # [M, K] teacher, at the rows selected by `sel`
    sel: torch.Tensor,  # [N, L] bool, the labelled mask slots
    block_pos: torch.Tensor,  # [N, L]
    weights: torch.Tensor,  # [B]
    head: HeadFn,
) -> torch.Tensor:
    """Position-weighted KL(teacher || student) over the block slots (pruning recovery)."""
    log_s = F.log_softmax(head(hidden[sel]).float(), -1)
    log_t = F.log_softmax(teacher_logits.float(), -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [M]
    w = weights.to(kl.device)[block_pos[sel] - 1]
    return (kl * w).sum() / w.sum().clamp(min=1e-9)


def build_label_map(head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: index of each token id in head_ids, IGNORE for tokens outside the head."""
    m = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    m[head_ids] = torch.arange(head_ids.numel())
    return m
