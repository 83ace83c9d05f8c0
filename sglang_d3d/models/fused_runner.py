"""One pass that verifies and drafts: each row's fused pack (models/packing.py) — the target's
verify block plus mask blocks anchored at its tokens — through a full-depth drafter over the
target's own cache.

Why this is exact: at full depth the drafter runs the target's layers unchanged on clean tokens
(its deltas act at mask slots only, models/adapters.py), so the verify block's logits and the
keys and values it writes are the target's. The masks see the verify tokens, never the other
way round (the pack's causal `sees`), so adding them changes nothing the target computes. On a
4-bit target the pass is the target's C++ layer loop with the deltas on the mask rows
(models/exact_drafter.py), where each row's arithmetic is a plain step's, bitwise.
"""

from __future__ import annotations

import torch

from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.packing import Pack, layout
from sglang_d3d.models.target import TargetRunner


class FusedRunner:
    def __init__(self, drafter: D3DDrafter, target: TargetRunner) -> None:
        if not drafter.is_full_depth:
            raise ValueError(
                "fused mode needs a full-depth drafter (it computes the target on clean "
                f"tokens); this one keeps {drafter.num_layers} of "
                f"{target.model.num_layers} layers: use sync or async"
            )
        d = drafter.mask_embedding
        if d.device != target.model.device or d.dtype != target.model.dtype:
            raise ValueError(
                f"fused mode runs drafter and target as one model: the drafter is on "
                f"{d.device} in {d.dtype}, the target on {target.model.device} in "
                f"{target.model.dtype}"
            )
        if target.model.fused().exact_rows and target.fast and not drafter.on_exact_loop():
            raise ValueError(
                "fused mode on 4-bit weights runs the drafter's pass on the target's C++ layer "
                "loop, which computes every verify row as a plain step does; the C++ CPU "
                "kernels did not build here: use target_weights 'fp32', or sync or async"
            )
        self.model = drafter
        self.target = target
        if target.fast:
            drafter.prepare_inference()

    @torch.inference_mode()
    def run(self, rows: list[tuple[int, Pack]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over fused packs (one per target slot). -> per row (verify logits
        [G+1, V], branch logits [K, B-1, V] of each branch's masks), in the model's dtype, as the
        target's own verify logits.

        Writes every input's keys and values past the row's length without advancing it: the
        verify block lands where `TargetRunner.forward_block` puts it, the masks in scratch
        after it. The caller advances the target by what it accepts."""
        slots, packs = [s for s, _ in rows], [p for _, p in rows]
        t = max(len(p.input_ids) for p in packs)
        ids, pos, write, mask = layout(packs, [self.target.lengths[s] for s in slots], t)
        dev = self.target.model.device
        h = self.model.hidden(ids.to(dev), pos.to(dev), mask.to(dev), self.target.cache, slots,
                              write.to(dev), fast=self.target.fast)  # [N, t, H]
        picks = [_scored(p) for p in packs]
        flat = torch.cat([h[r, idx.to(dev)] for r, idx in enumerate(picks)])  # [sum, H]
        logits = self.model.logits(flat, fast=self.target.fast)  # [sum, V]
        return _split(logits, packs)


def _scored(p: Pack) -> torch.Tensor:
    """Pack indices whose outputs are used: the verify block, then each branch's masks (its
    anchor is a verify token, scored already)."""
    return torch.tensor(p.blocks[0] + [i for blk in p.blocks[1:] for i in blk[1:]])


def _split(logits: torch.Tensor, packs: list[Pack]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, at = [], 0
    for p in packs:
        g1 = len(p.blocks[0])
        k, m = len(p.blocks) - 1, (len(p.blocks[1]) - 1 if len(p.blocks) > 1 else 0)
        verify = logits[at : at + g1]  # [G+1, V]
        branches = logits[at + g1 : at + g1 + k * m].reshape(k, m, logits.shape[-1])  # [K, B-1, V]
        out.append((verify, branches))
        at += g1 + k * m
    return out
