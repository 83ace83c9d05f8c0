"""Losses of the mask slots. Pure functions over logits, each tested alone.

Rows arrive already sampled with probability proportional to their weight (training/objective.py:
draft_weights by position, or chain_weights by the target's confidence), so every loss here is a
plain mean: sampling instead of weighting spends the (full-vocabulary) LM head only on the rows
that matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_rows(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """[M] KL(teacher || student) of each row; student, teacher [M, V] logits."""
    log_s = F.log_softmax(student.float(), -1)
    log_t = F.log_softmax(teacher.float(), -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) over rows; student, teacher [M, V] logits."""
    return kl_rows(student, teacher).mean()


def label_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[M] probability each row of logits [M, V] gives its label [M]."""
    logits = logits.float()
    picked = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    return (picked - logits.logsumexp(-1)).exp()


def hard_ce(student: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy against the target's greedy tokens; student [M, V], labels [M]."""
    return F.cross_entropy(student.float(), labels)


def slot_loss_rows(student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor,
                   kind: str) -> torch.Tensor:
    """[M] loss of each row (summed, then divided by the rows of the whole global batch, when
    the batch is split across ranks: training/distributed.py)."""
    if kind == "kl":
        return kl_rows(student, teacher)
    if kind == "ce":
        return F.cross_entropy(student.float(), labels, reduction="none")
    raise ValueError(f"loss must be 'kl' or 'ce', not {kind!r}")


def slot_loss(student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor,
              kind: str) -> torch.Tensor:
    if student.shape[0] == 0:
        return student.sum() * 0.0
    if kind == "kl":
        return kl_to_teacher(student, teacher)
    if kind == "ce":
        return hard_ce(student, labels)
    raise ValueError(f"loss must be 'kl' or 'ce', not {kind!r}")


@torch.no_grad()
def hits_by_draft(student: torch.Tensor, labels: torch.Tensor, draft: torch.Tensor,
                  block: int) -> torch.Tensor:
    """[2, B+1] (top-1 hits, rows) of each draft index d: counts add up across micro-batches
    and ranks, where ratios would not."""
    hit = (student.argmax(-1) == labels).float().cpu()
    draft = draft.cpu()
    tot = torch.zeros(block + 1).index_add_(0, draft, torch.ones_like(hit))
    return torch.stack([torch.zeros(block + 1).index_add_(0, draft, hit), tot])


def accuracy_from_hits(hits: torch.Tensor) -> torch.Tensor:
    """[2, B+1] counts -> [B+1] accuracy (NaN where no row)."""
    return torch.where(hits[1] > 0, hits[0] / hits[1].clamp(min=1), float("nan"))


@torch.no_grad()
def accuracy_by_draft(student: torch.Tensor, labels: torch.Tensor, draft: torch.Tensor,
                      block: int) -> torch.Tensor:
    """[B+1] top-1 accuracy of draft index d (NaN where no row of that index)."""
    hit = (student.argmax(-1) == labels).float()
    tot = torch.zeros(block + 1).index_add_(0, draft, torch.ones_like(hit))
    acc = torch.zeros(block + 1).index_add_(0, draft, hit)
    return torch.where(tot > 0, acc / tot.clamp(min=1), float("nan"))
