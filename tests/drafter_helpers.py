"""Helpers for drafter tests: trained-looking deltas and one pass over a mask block."""

from __future__ import annotations

import torch

from sglang_d3d.models.drafter import MASK_ID

# Four clean tokens, then a bidirectional block of two mask slots.
IDS = torch.tensor([[5, 9, 7, 3, MASK_ID, MASK_ID]])


def noisy(drafter, std=0.05, seed=0):
    """Give the drafter's trainable parameters random values, as training would (zero deltas
    would make every format test pass trivially)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
    return drafter


def run_block(drafter, ids):
    """Hidden states of one pass: causal over the clean tokens, the last two a mask block."""
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0)
    mask[:, -2:, -2:] = True
    return drafter.hidden(ids, torch.arange(t).unsqueeze(0), mask)  # [1, t, hidden]
