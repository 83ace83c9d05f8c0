"""The target side of speculative decoding: prefill, verify a block, roll back.

Invariant: a row's cache holds every accepted token except the last one, which is the first
input of the next verify (or decode) pass. Rolling back is just not advancing `lengths`.
"""

from __future__ import annotations

import torch

from sglang_d3d.models.decoder import Batch, Decoder, Segment
from sglang_d3d.models.exact_pass import chain_plan


class TargetRunner:
    def __init__(self, model: Decoder, num_slots: int, max_len: int, fast: bool = True) -> None:
        self.model = model
        self.cache = model.make_cache(num_slots, max_len)
        self.lengths = [0] * num_slots
        # Fused, packed projections (models/fused.py): a CPU speed-up, and a second copy of
        # the weights, which a GPU's memory is better spent on.
        self.fast = fast and model.device.type == "cpu"
        if self.fast:
            model.fused()  # pack now (about a second), not inside the first request's prefill

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Cache the prompt; -> logits [V] for the first new token."""
        return self.prefill_chunks([(slot, 0, ids)])[0]

    @torch.inference_mode()
    def prefill_chunks(self, chunks: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Chunks (slot, start, ids) of prompts, in one packed pass: `ids` go to the slot's
        cache from index `start` (the prompt's tokens before it are cached already).
        -> logits [len(chunks), V] after each chunk's last token; the slot's length becomes
        start + len(ids). A failed pass leaves the lengths as they were (safe to retry)."""
        segs, offset = [], 0
        for slot, start, ids in chunks:
            segs.append(Segment(slot, offset, start, len(ids)))
            offset += len(ids)
        dev = self.model.device
        tokens = torch.tensor([[t for _, _, ids in chunks for t in ids]], device=dev)  # [1, T]
        pos = torch.cat([s.start + torch.arange(s.length) for s in segs]).unsqueeze(0).to(dev)
        pick = torch.tensor([[s.offset + s.length - 1 for s in segs]])  # [1, K]
        b = Batch(pos, None, self.cache, [s.slot for s in segs], pos, segments=segs)
        logits = self.model(tokens, b, fast=self.fast, pick=pick)[0]  # [K, V]
        for s in segs:
            self.lengths[s.slot] = s.end
        return logits

    @torch.inference_mode()
    def forward_block(self, slots: list[int], tokens: torch.Tensor,
                      trees: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens [N, T] appended (causally) after each row's cache -> logits [N, T, V].

        Writes the block's keys/values past each row's length without advancing it: the caller
        commits what was accepted with `advance` (a tree's path first with `keep_path`).
        `trees`: (depths [N, T] long, ancestors [N, T, T] bool) where the block is a token tree
        (speculative/tree.py): input i sits at position length + depths[i] and attends to the
        cache and its own ancestors; None is a chain (depths 0..T-1, causal)."""
        n, t = tokens.shape
        dev = self.model.device
        exact = self.fast and self.model.fused().exact_rows
        lengths = [self.lengths[s] for s in slots]
        start = torch.tensor(lengths).unsqueeze(1)  # [N, 1]
        at = start + torch.arange(t)  # [N, T] cache indices
        if exact and trees is None:  # a chain: query i of a row sees the row's first start + i + 1 entries
            at = at.to(dev)
            b = Batch(at, None, self.cache, slots, at, exact_rows=True, plan=chain_plan(lengths, t))
            return self.model(tokens.to(dev), b, fast=True)
        span = int(at.max()) + 1
        mask = torch.arange(span).view(1, 1, span) <= at.unsqueeze(-1)  # [N, T, span]
        pos = at
        if trees is not None:
            depths, ancestors = trees
            pos = start + depths
            mask = mask & (torch.arange(span).view(1, 1, span) < start.unsqueeze(-1))  # the cache
            for r, a in enumerate(start[:, 0].tolist()):
                mask[r, :, a : a + t] = ancestors[r]
        b = Batch(pos.to(dev), mask.to(dev), self.cache, slots, at.to(dev), exact_rows=exact)
        return self.model(tokens.to(dev), b, fast=self.fast)

    def keep_path(self, slot: int, path: list[int]) -> None:
        """A tree's accepted nodes (block indices, root 0 excluded) move to the cache entries
        right after the root, where a chain would have written them."""
        base = self.lengths[slot]
        moved = [(base + i, base + k) for k, i in enumerate(path, start=1) if i != k]
        if moved:
            src, dst = zip(*moved)
            self.cache.copy_positions(slot, list(src), list(dst))

    def advance(self, slot: int, n: int) -> None:
        self.lengths[slot] += n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    @torch.inference_mode()
    def fork(self, src: int, dst: int) -> None:
        """dst starts as a copy of src's committed tokens (choices of one prompt share its
        prefill)."""
        self.cache.copy_slot(src, dst, self.lengths[src])
        self.lengths[dst] = self.lengths[src]
