"""The drafter side: its own KV cache of the accepted prefix, packed passes, branch commits."""

from __future__ import annotations

import torch

from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.kv_cache import KVCache
from sglang_d3d.models.packing import Pack, branch_token_index, layout

EXACT_ROWS = 16  # inputs up to which an int8 runner's pass takes the 4-bit C++ loop instead


class DraftRunner:
    def __init__(self, drafter: D3DDrafter, num_slots: int, max_len: int, fast: bool = True,
                 int8: bool = False, exact_rows: int | None = None, coarse: bool = True) -> None:
        """exact_rows: with int8, passes of up to this many inputs take the 4-bit target's C++
        loop where the drafter has one (default EXACT_ROWS; 0: never). coarse: passes on that
        loop round their projections' inputs to 8 bits, not the target's 14
        (models/csrc/block_mm.cpp): drafts only propose and the target verifies each, so the
        output is the same, and a pass costs less (`benchmarks/bench_passes.py`). The cache
        is the runner's own, so no target row ever sees them."""
        self.model = drafter
        self.coarse = coarse
        self.exact_rows = EXACT_ROWS if exact_rows is None else exact_rows
        self.cache = drafter.make_cache(num_slots, max_len)
        self.lengths = [0] * num_slots
        # The target's fused CPU kernels plus the deltas (models/adapters.py GatedFused);
        # int8: an int8 copy of both (models/int8_deltas.py).
        self.fast = fast and self.device.type == "cpu"
        self.int8 = int8 and self.fast
        if self.fast:
            drafter.prepare_inference(self.int8)

    @property
    def device(self) -> torch.device:
        return self.model.mask_embedding.device

    @torch.inference_mode()
    def run(self, rows: list[tuple[int, Pack]]) -> list[torch.Tensor]:
        """One batched pass over packs (one per slot). -> per row logits [num_blocks, B, V].

        Tokens counted in a pack's `num_commit` join the committed prefix.
        """
        slots = [s for s, _ in rows]
        t = max(len(p.input_ids) for _, p in rows)
        lens = [self.lengths[s] for s in slots]
        ids, pos, write, mask = layout([p for _, p in rows], lens, t)
        dev = self.device
        int8 = self.int8 and not self._exact_loop(len(rows) * t)
        h = self.model.hidden(
            ids.to(dev), pos.to(dev), mask.to(dev), self.cache, slots, write.to(dev),
            fast=self.fast, int8=int8, coarse=self.coarse,
        )
        picks = [torch.tensor(p.blocks, dtype=torch.long).view(-1) for _, p in rows]  # [num_blocks * B] each
        flat = torch.cat([h[r, idx.to(dev)] for r, idx in enumerate(picks)])  # [sum, H]
        logits = self.model.logits(flat, fast=self.fast, int8=int8).float() if flat.shape[0] else flat.new_zeros(0, 1)
        out, at = [], 0
        for _, p in rows:
            k, b = len(p.blocks), len(p.blocks[0]) if p.blocks else 0
            out.append(logits[at : at + k * b].reshape(k, b, logits.shape[-1]))
            at += k * b
        for s, p in rows:
            self.lengths[s] += p.num_commit
        return out

    def _exact_loop(self, rows: int) -> bool:
        """A pass of `rows` inputs runs on the 4-bit target's C++ loop (models/exact_drafter.py)
        even where the runner has int8 copies: up to EXACT_ROWS inputs the 4-bit loop was the
        faster of the two (default target, 200-token context, 1 thread, thread CPU time,
        medians of 9 in turn: a block of 4 after one new token 34 ms against 79; 3 drafts and
        3 branches of 4, 15 inputs, 95 against 110; 4 branches, 19 inputs, 135 against 116)."""
        return self.fast and rows <= self.exact_rows and self.model.on_exact_loop()

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], chunk: int = 512) -> None:
        """Commit `tokens` to the slot's cache with causal chunks: masks are built as tensors,
        never as per-token lists, so a long prompt costs O(P * chunk) mask work, not O(P^2)
        Python (a 4k-token prompt took 11 s through the pack path)."""
        dev = self.device
        for start in range(0, len(tokens), chunk):
            part = torch.tensor(tokens[start : start + chunk], device=dev).unsqueeze(0)  # [1, c]
            c, base = part.shape[1], self.lengths[slot]
            pos = torch.arange(base, base + c, device=dev).unsqueeze(0)  # [1, c]
            mask = torch.ones(c, base + c, dtype=torch.bool, device=dev).tril(base)  # causal
            self.model.hidden(part, pos, mask.unsqueeze(0), self.cache, [slot], pos,
                              fast=self.fast, int8=self.int8, coarse=self.coarse)
            self.lengths[slot] = base + c

    def adopt(self, slot: int, source: KVCache, n: int) -> None:
        """Commit the next n tokens by copying their keys and values from `source` (the
        target's cache, same slot and positions) instead of computing them: at full depth a
        clean token's entries are the target's own (models/adapters.py)."""
        base = self.lengths[slot]
        self.cache.copy_range_from(source, slot, base, base + n)
        self.lengths[slot] = base + n

    def commit(self, slot: int, n: int) -> None:
        """Keep n more tokens already written at their final indices (e.g. accepted drafts)."""
        self.lengths[slot] += n

    def commit_branch(self, slot: int, num_drafts: int, branch: int, accepted: int, block: int):
        """A pre-drafted branch was hit: its accepted drafts are in place; move its token."""
        base = self.lengths[slot]
        src = base + branch_token_index(num_drafts, branch, block)
        self.cache.copy_positions(slot, [src], [base + accepted])
        self.lengths[slot] = base + accepted + 1

    def rollback(self, slot: int, n: int) -> None:
        """Forget the last n committed tokens (their entries are rewritten when re-read)."""
        self.lengths[slot] -= n

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
