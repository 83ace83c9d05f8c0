"""The target side of speculative decoding: prefill, verify a block, roll back.

Invariant: a row's cache holds every accepted token except the last one, which is the first
input of the next verify (or decode) pass. Rolling back is just not advancing `lengths`.
"""

from __future__ import annotations

import torch

from sglang_d3d.models.decoder import Batch, Decoder


class TargetRunner:
    def __init__(self, model: Decoder, num_slots: int, max_len: int, fast: bool = True) -> None:
        self.model = model
        self.cache = model.make_cache(num_slots, max_len)
        self.lengths = [0] * num_slots
        # Fused, packed projections (models/fused.py): a CPU speed-up, and a second copy of
        # the weights, which a GPU's memory is better spent on.
        self.fast = fast and model.device.type == "cpu"

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Cache the prompt; -> logits [V] for the first new token."""
        self.lengths[slot] = 0
        logits = self.forward_block([slot], torch.tensor([ids]), last_only=True)
        self.lengths[slot] = len(ids)
        return logits[0, -1]

    @torch.inference_mode()
    def forward_block(
        self, slots: list[int], tokens: torch.Tensor, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [N, T] appended (causally) after each row's cache -> logits [N, T, V]
        ([N, 1, V] for the last position alone with `last_only`).

        Writes the block's keys/values past each row's length without advancing it: the caller
        commits what was accepted with `advance`.
        """
        n, t = tokens.shape
        start = torch.tensor([self.lengths[s] for s in slots]).unsqueeze(1)  # [N, 1]
        pos = start + torch.arange(t)  # [N, T]
        span = int(pos.max()) + 1
        mask = torch.arange(span).view(1, 1, span) <= pos.unsqueeze(-1)  # [N, T, span]
        dev = self.model.device
        b = Batch(pos.to(dev), mask.to(dev), self.cache, slots, pos.to(dev))
        return self.model(tokens.to(dev), b, fast=self.fast, last_only=last_only)

    def advance(self, slot: int, n: int) -> None:
        self.lengths[slot] += n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
