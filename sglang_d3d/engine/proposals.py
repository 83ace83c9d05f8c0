"""What a cycle puts to the target besides the controller's plan: cut chains, token trees and
guesses copied from the request's own text. One frozen value, so calibration swaps it whole
(every cycle it times must be a plan's) and puts the served one back, instead of flipping
several engine attributes one by one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sglang_d3d.config import EngineConfig
from sglang_d3d.speculative.cycle import Proposing


@dataclass(frozen=True)
class Proposals:
    # the EngineConfig fields of the same names; all 0 where drafting is fused (its own chains)
    draft_cutoff: float = 0.0  # verify drafts while the drafter's confidence holds
    tree_nodes: int = 0  # token trees of this many drafts (0: chains)
    lookup_tokens: int = 0  # up to this many guesses copied from the text, in the tree
    copy_ngram: int = 0  # cycles of copies without a drafter pass (0: never)

    @classmethod
    def of(cls, cfg: EngineConfig, separate_drafter: bool) -> Proposals:
        """The served settings: cfg's where the drafter runs passes of its own (sync, async);
        none for fused drafting, which drafts inside the verify pass."""
        if not separate_drafter:
            return cls()
        return cls(cfg.draft_cutoff, cfg.tree_nodes, cfg.lookup_tokens, cfg.copy_ngram)

    def for_calibration(self) -> Proposals:
        """Whole blocks (the dearest cycle of a plan) and no cycles of copies, which are
        nobody's plan: each calibrated cycle is then the plan's own."""
        return dataclasses.replace(self, draft_cutoff=0.0, copy_ngram=0)

    def for_cycle(self, batch: int, budget: int, copies: list[list[int]]) -> Proposing:
        """One cycle's: `copies` per row ([]: draft) for the rows that verify theirs alone."""
        return Proposing(self.draft_cutoff, self.tree_nodes, self.lookup(batch, budget),
                         tuple(copies))

    def lookup(self, batch: int, budget: int, beside: int | None = None) -> int:
        """Copied guesses per row this cycle: as many as fit in the verify token budget
        beside `beside` other drafts per row (default: the drafter's tree; a cycle of copies
        has nothing beside them). With the default budget of 64 a batch of 1 or 4 takes all 8
        and 16 rows none."""
        beside = self.tree_nodes if beside is None else beside
        room = budget // batch - 1 - beside
        return max(0, min(self.lookup_tokens, room))
