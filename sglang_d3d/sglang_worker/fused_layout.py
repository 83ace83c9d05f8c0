"""Where each row of a fused forward sits: the verify block, then the next block's branches.

Per request, one fused forward holds T = W + K x M rows (speculative/fused.py's cycle,
models/packing.fused_pack's pack):

    verify   W tokens [c, d1 .. d_{W-1}] at positions L .. L+W-1, written to the KV slots
             SGLang reserved; causal, exactly SGLang's verify rows
    branch k M masks anchored at verify index j_k ("j_k drafts accepted"), at positions
             L + j_k + 1 .. L + j_k + M; each sees the prefix, verify tokens 0 .. j_k and its
             own branch's masks; nothing sees a mask, and masks write no KV slot of the request

Every request has the same K (a request with fewer likely outcomes repeats an anchor), so the
forward is a rectangle [N, T]. The pack's shape depends only on (W, anchors, M), never on the
tokens, so it is built once per anchor pattern and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from sglang_d3d.models.packing import fused_pack
from sglang_d3d.speculative.fused import choose_anchors


@dataclass(frozen=True)
class RowShape:
    """One anchor pattern's rows, relative to the verify block's first position."""

    rel_pos: tuple[int, ...]  # [T] position offset of each row
    sees_verify: tuple[tuple[bool, ...], ...]  # [K*M][W]: mask row sees verify token w
    sees_masks: tuple[tuple[bool, ...], ...]  # [K*M][K*M]: mask row sees mask row


@lru_cache(maxsize=256)
def row_shape(width: int, anchors: tuple[int, ...], masks: int) -> RowShape:
    """width W verify tokens, anchors (verify indices), M masks a branch."""
    pack = fused_pack([0] * width, list(anchors), masks + 1)
    t = len(pack.input_ids)
    sees = [set(s) for s in pack.sees[width:]]
    return RowShape(
        tuple(pack.rel_pos),
        tuple(tuple(w in s for w in range(width)) for s in sees),
        tuple(tuple(m in s for m in range(width, t)) for s in sees),
    )


def anchors_for(keep: list[float] | None, width: int, branches: int) -> tuple[int, ...]:
    """`branches` anchors among verify indices 0 .. width-1, likeliest outcomes first chosen
    (speculative/fused.choose_anchors over the drafter's own probabilities `keep`, W-1 of
    them); None: the drafts are placeholders, so outcome 0 is certain. Padded to `branches`
    by repeating the last anchor (a duplicate branch: the rectangle stays whole)."""
    if branches >= width:
        return tuple(range(width)) + (width - 1,) * (branches - width)
    keep = [0.0] * (width - 1) if keep is None else keep
    out = choose_anchors(keep, branches)
    return tuple(out) + (out[-1],) * (branches - len(out))


@dataclass(frozen=True)
class BatchLayout:
    """The batch's rectangle, on the device."""

    width: int  # W
    masks: int  # M
    rel_pos: torch.Tensor  # [N, T] long
    sees_verify: torch.Tensor  # [N, K*M, W] bool
    sees_masks: torch.Tensor  # [N, K*M, K*M] bool
    anchors: torch.Tensor  # [N, K] long

    @property
    def tokens(self) -> int:  # T
        return self.rel_pos.shape[1]

    def mask_rows(self) -> torch.Tensor:
        """Flat indices [N * K*M] of the mask rows in the [N * T] forward."""
        n, t = self.rel_pos.shape
        dev = self.rel_pos.device
        return (torch.arange(n, device=dev)[:, None] * t
                + torch.arange(self.width, t, device=dev)[None, :]).reshape(-1)


def batch_layout(anchors: list[tuple[int, ...]], width: int, masks: int,
                 device: torch.device) -> BatchLayout:
    shapes = [row_shape(width, a, masks) for a in anchors]
    return BatchLayout(
        width, masks,
        torch.tensor([s.rel_pos for s in shapes], dtype=torch.int64).to(device),
        torch.tensor([s.sees_verify for s in shapes], dtype=torch.bool).to(device),
        torch.tensor([s.sees_masks for s in shapes], dtype=torch.bool).to(device),
        torch.tensor(anchors, dtype=torch.int64).to(device),
    )  # fmt: skip


def mask_row_mask(layout: BatchLayout, prefix_lens: torch.Tensor, span: int) -> torch.Tensor:
    """-> [N, 1, K*M, span + K*M] bool: which keys each mask row sees, over the pool's columns
    0 .. span-1 (row i's prefix < prefix_lens[i], then its verify block) and then the mask rows'
    own fresh keys."""
    w = layout.width
    cols = torch.arange(span, device=prefix_lens.device)
    rel = cols[None, :] - prefix_lens.to(torch.int64)[:, None]  # [N, span]
    in_block = (rel >= 0) & (rel < w)
    idx = rel.clamp(0, w - 1)[:, None, :].expand(-1, layout.sees_verify.shape[1], -1)
    verify = layout.sees_verify.gather(2, idx) & in_block[:, None, :]  # [N, KM, span]
    pool = (rel < 0)[:, None, :] | verify
    return torch.cat([pool, layout.sees_masks], 2)[:, None]
