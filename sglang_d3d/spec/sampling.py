"""Logits -> probabilities under a request's sampling parameters, and seeded draws.

The processed distribution is what speculative verification must reproduce exactly, so the
target's logits always go through `target_probs` (temperature, top-k, top-p, in that order).
"""

from __future__ import annotations

import torch

from sglang_d3d.config import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32). Greedy is a one-hot on the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (the top one always)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token
    drop_sorted = before >= top_p
    drop_sorted[..., 0] = False  # even a top_p that rounds to 0 keeps the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The drafter's proposal distribution q [..., V]. Any q is exact under rejection sampling;
    matching the target's temperature keeps acceptance high."""
    temperature = params.temperature if not params.greedy else 1.0
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
