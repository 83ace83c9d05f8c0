"""The D3D training example: a clean sequence plus mask blocks packed behind it.

For a sequence x_0 .. x_{T-1} (prompt + response) and anchors a_1 .. a_K in the response, one
packed row holds
    [x_0 .. x_{T-1} | M x B (anchor a_1) | ... | M x B (anchor a_K)]
The clean part is causal. Block k's slot j (j = 1..B) sits at RoPE position a_k + j, sees the
clean tokens x_0 .. x_{a_k} and the B slots of its own block (bidirectionally), and is labelled
x_{a_k + j}. That is exactly the inference pass: after the last accepted token x_{a_k}, the
drafter fills B mask slots (B-1 drafts and its guess of the bonus token; docs/design.md).
The blocks never see each other, so K anchors cost one pass over T + K*B tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.models.drafter import MASK_ID

IGNORE = -100  # label of positions without a loss


@dataclass(frozen=True)
class Example:
    input_ids: torch.Tensor  # [L] long, MASK_ID at mask slots
    positions: torch.Tensor  # [L] long
    mask: torch.Tensor  # [L, L] bool, True = may attend
    labels: torch.Tensor  # [L] long, IGNORE on clean tokens and slots past the sequence end
    block_pos: torch.Tensor  # [L] long, j = 1..B on mask slots, 0 on clean tokens
    ar_labels: torch.Tensor  # [L] long, x_{t+1} on clean positions with an AR loss, else IGNORE


def sample_anchors(prompt_len: int, total_len: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """Up to `num` distinct anchors in [prompt_len - 1, total_len - 2], sorted.

    The last prompt token is a valid anchor: the first block after prefill predicts the first
    response tokens. An anchor needs at least one token after it to have a label.
    """
    lo, hi = max(prompt_len - 1, 0), total_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    span = hi - lo + 1
    pick = torch.randperm(span, generator=gen)[: min(num, span)]
    return torch.sort(pick + lo).values


def block_mask(total_len: int, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[T + K*B, T + K*B] bool: causal clean part; block k sees x_0..x_{a_k} and itself."""
    t, k = total_len, anchors.numel()
    size = t + k * block
    m = torch.zeros(size, size, dtype=torch.bool)
    m[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    for i, a in enumerate(anchors.tolist()):
        rows = slice(t + i * block, t + (i + 1) * block)
        m[rows, : a + 1] = True
        m[rows, rows] = True
    return m


def ar_label_row(ids: torch.Tensor, lo: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """[T] labels x_{t+1} at up to `num` random clean positions t in [lo, T-2], else IGNORE.

    Subsampled because every labelled position costs a row of the LM head.
    """
    t = ids.numel()
    out = torch.full((t,), IGNORE, dtype=torch.long)
    cand = torch.arange(max(lo, 0), t - 1)
    if num <= 0 or cand.numel() == 0:
        return out
    pick = cand[torch.randperm(cand.numel(), generator=gen)[:num]]
    out[pick] = ids[pick + 1]
    return out


def build_example(
    ids: torch.Tensor,  # [T] long, prompt + response
    anchors: torch.Tensor,  # [K] long
    block: int,
    ar_labels: torch.Tensor | None = None,  # [T] long
) -> Example:
    t, k = ids.numel(), anchors.numel()
    j = torch.arange(1, block + 1)  # [B]
    slot_pos = (anchors.unsqueeze(1) + j).reshape(-1)  # [K*B]
    in_range = slot_pos < t
    slot_labels = torch.where(in_range, ids[slot_pos.clamp(max=t - 1)], IGNORE)
    none = torch.full((t,), IGNORE, dtype=torch.long)
    return Example(
        input_ids=torch.cat([ids, torch.full((k * block,), MASK_ID, dtype=torch.long)]),
        positions=torch.cat([torch.arange(t), slot_pos]),
        mask=block_mask(t, anchors, block),
        labels=torch.cat([none, slot_labels]),
        block_pos=torch.cat([torch.zeros(t, dtype=torch.long), j.repeat(k)]),
        ar_labels=torch.cat([none if ar_labels is None else ar_labels,
                             torch.full((k * block,), IGNORE, dtype=torch.long)]),
    )


def collate(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding rows see only themselves and carry no loss."""
    size = max(e.input_ids.numel() for e in examples)
    n = len(examples)
    out = {
        "input_ids": torch.zeros(n, size, dtype=torch.long),
        "positions": torch.zeros(n, size, dtype=torch.long),
        "mask": torch.eye(size, dtype=torch.bool).repeat(n, 1, 1),
        "labels": torch.full((n, size), IGNORE, dtype=torch.long),
        "block_pos": torch.zeros(n, size, dtype=torch.long),
        "ar_labels": torch.full((n, size), IGNORE, dtype=torch.long),
    }
    for i, e in enumerate(examples):
        length = e.input_ids.numel()
        for key in ("input_ids", "positions", "labels", "block_pos", "ar_labels"):
            out[key][i, :length] = getattr(e, key)
        out["mask"][i, :length, :length] = e.mask
    return out


def position_weights(block: int, gamma: float | None) -> torch.Tensor:
    """[B] loss weight of slot j = 1..B: exp(-(j-1)/gamma), so early slots count more.

    An early miss ends acceptance, so the first slots matter most (DFlash uses gamma = 7 for
    B = 16). gamma None or <= 0: uniform.
    """
    j = torch.arange(block, dtype=torch.float32)
    if gamma is None or gamma <= 0:
        return torch.ones(block)
    return torch.exp(-j / gamma)

