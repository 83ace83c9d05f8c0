"""The D3D training example, in the one block layout the engine runs (models/drafter.py).

For a sequence x_0 .. x_{T-1} (prompt + the target's own response) and anchors a_1 .. a_K in
the response, a training step makes two passes:
  clean pass  x_0 .. x_{T-1}, causal, no gradient. At full depth it is exactly the target, so
              it also gives the teacher's distribution at every position for free.
  block pass  for each anchor a_k, B-1 mask slots at RoPE positions a_k+1 .. a_k+B-1. Slot j
              sees the clean keys x_0 .. x_{a_k} and the slots of its own block
              (bidirectional), and predicts x_{a_k+j+1}: it is draft j+1 of the block whose
              anchor x_{a_k} gives draft 1.
Blocks never see each other, so K anchors cost one block pass over K*(B-1) tokens, and every
gradient is spent on mask slots (clean tokens carry no deltas: models/adapters.py).

Worked example, B = 4, anchor a = 5: slots at positions 6, 7, 8 see x_0..x_5 and each other,
and are labelled x_7, x_8, x_9 (drafts 2, 3, 4; draft 4 is the bonus-token guess). Their
teacher rows are clean positions 6, 7, 8, whose target logits predict x_7, x_8, x_9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # label of slots without a loss


@dataclass(frozen=True)
class Example:
    ids: torch.Tensor  # [T] long, prompt + response
    slot_pos: torch.Tensor  # [S] long, RoPE position a + j of each mask slot (S = sum of B_k - 1)
    slot_draft: torch.Tensor  # [S] long, the draft index j + 1 (2 .. B_k) each slot gives
    labels: torch.Tensor  # [S] long, x_{a+j+1}, IGNORE past the sequence end
    slot_anchor: torch.Tensor  # [S] long, the anchor a of the slot's block
    slot_block: torch.Tensor  # [S] long, which block (0 .. K-1) the slot belongs to


def sample_anchors(prompt_len: int, total_len: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """Up to `num` distinct anchors in [prompt_len - 1, total_len - 3], sorted.

    The last prompt token is a valid anchor (the first block after prefill); an anchor needs
    x_{a+2} to exist for its first mask slot to carry a label.
    """
    lo, hi = max(prompt_len - 1, 0), total_len - 3
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(hi - lo + 1, generator=gen)[: min(num, hi - lo + 1)]
    return torch.sort(pick + lo).values


def sample_block_sizes(num: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """[num] block sizes uniform in [lo, hi]: a drafter trained on mixed sizes drafts well at
    any of them, so the engine may verify shorter blocks than the largest it was trained for."""
    return torch.randint(lo, hi + 1, (num,), generator=gen)


def build_example(ids: torch.Tensor, anchors: torch.Tensor, blocks: int | torch.Tensor) -> Example:
    """blocks: one block size B for every anchor, or [K] sizes, one per anchor."""
    t, k = ids.numel(), anchors.numel()
    sizes = torch.full((k,), blocks) if isinstance(blocks, int) else blocks
    m = sizes - 1  # [K] mask slots per block
    j = torch.cat([torch.arange(1, b) for b in sizes.tolist()]) if k else torch.zeros(0, dtype=torch.long)
    slot_anchor = anchors.repeat_interleave(m)  # [S]
    pos = slot_anchor + j
    nxt = pos + 1
    labels = torch.where(nxt < t, ids[nxt.clamp(max=t - 1)], IGNORE)
    return Example(ids, pos, j + 1, labels, slot_anchor, torch.arange(k).repeat_interleave(m))


def block_mask(t: int, slot_anchor: torch.Tensor, slot_block: torch.Tensor,
               clean_width: int) -> torch.Tensor:
    """[S, clean_width + S] bool: slot rows see x_0..x_a and their own block.
    Columns: `clean_width` clean keys (the padded clean length), then the slots."""
    cols = torch.arange(clean_width)
    clean = (cols.unsqueeze(0) <= slot_anchor.unsqueeze(1)) & (cols < t).unsqueeze(0)
    own = slot_block.unsqueeze(1) == slot_block.unsqueeze(0)  # [S, S]
    return torch.cat([clean, own], 1)


def collate(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-pad clean rows and slot rows. Padding slots see the first clean token only (so
    attention stays finite) and carry no label."""
    n = len(examples)
    t = max(e.ids.numel() for e in examples)
    km = max(e.slot_pos.numel() for e in examples)
    out = {
        "ids": torch.zeros(n, t, dtype=torch.long),
        "clean_mask": torch.ones(t, t, dtype=torch.bool).tril().repeat(n, 1, 1),
        "slot_pos": torch.zeros(n, km, dtype=torch.long),
        "slot_draft": torch.ones(n, km, dtype=torch.long),
        "labels": torch.full((n, km), IGNORE, dtype=torch.long),
        "slot_mask": torch.zeros(n, km, t + km, dtype=torch.bool),
    }
    out["slot_mask"][:, :, 0] = True
    for i, e in enumerate(examples):
        length, k = e.ids.numel(), e.slot_pos.numel()
        out["ids"][i, :length] = e.ids
        out["slot_pos"][i, :k] = e.slot_pos
        out["slot_draft"][i, :k] = e.slot_draft
        out["labels"][i, :k] = e.labels
        m = block_mask(length, e.slot_anchor, e.slot_block, t)
        out["slot_mask"][i, :k, :t] = m[:, :t]
        out["slot_mask"][i, :k, t : t + k] = m[:, t:]
    out["clean_pos"] = torch.arange(t).expand(n, t)
    return out


def draft_weights(block: int, gamma: float | None) -> torch.Tensor:
    """[B+1] weight of draft d = 1..B at index d (index 0 unused): exp(-(d-1)/gamma).

    An early miss ends acceptance, so early drafts count more (DFlash uses gamma = 7 for
    B = 16). gamma None or <= 0: uniform.
    """
    d = torch.arange(block + 1, dtype=torch.float32)
    w = torch.ones(block + 1) if gamma is None or gamma <= 0 else torch.exp(-(d - 1) / gamma)
    w[0] = 0.0
    return w


SLOT_WEIGHTS = ("position", "confidence")


def chain_weights(conf: torch.Tensor, slot_draft: torch.Tensor) -> torch.Tensor:
    """[N, S] weight of each slot: the product of `conf` over the earlier slots of its block.

    conf [N, S]: the target's probability of each slot's own label (how sure the target was of
    the token that slot drafts). slot_draft [N, S]: draft index; each block's slots run 2..B in
    order. A draft counts only if every earlier draft of its block was accepted, and the drafter
    seldom gets right a token the target itself was unsure of, so a slot after such a token is
    worth little (the confidence-adaptive weighting of PARD-2). Draft 1 is the target's own
    prediction at full depth, always accepted, so it brings no factor: draft 2 weighs 1.
    """
    log_c = conf.clamp_min(1e-12).log()
    before = log_c.cumsum(-1) - log_c  # [N, S] sum of log conf over all earlier slots of the row
    idx = torch.arange(conf.shape[-1], device=conf.device).expand_as(slot_draft)
    start = torch.where(slot_draft == 2, idx, 0).cummax(-1).values  # [N, S] first slot of block
    return (before - before.gather(-1, start)).exp()
