"""What drafting keeps per request (`DraftState`), apart from the request itself.

Hosts (the embedded engine's `Sequence`, the SGLang worker's request table) keep request state:
the tokens they emitted, stats, finish. Drafting keeps the drafter's view of the same request in
a `DraftState` it creates (`Drafting.start`) and alone writes; hosts read it only through what
the cycle returns (speculative/cycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.branches import Branch
from sglang_d3d.speculative.grammar import Constraint
from sglang_d3d.speculative.lookup import NgramIndex
from sglang_d3d.speculative.sampling import RequestRandom


@dataclass
class DraftState:
    slot: int  # the request's row in the drafter's cache
    params: SamplingParams  # drafts are sampled like the target samples (greedy: argmax)
    generator: RequestRandom | None  # the request's random streams (speculative/sampling.py)
    tokens: list[int]  # the request's tokens (prompt + accepted output) as drafting knows them
    pending: list[int]  # the tail of `tokens` the drafter cache has not read yet
    draft: list[int] | None = None  # drafts for the next verify
    # [G+1, V] drafter distributions of those slots; None with a draft: drafts proposed with
    # probability one (verify.py: a point mass, exact), a placeholder (drafter unavailable)
    # or a run copied from the text in place of drafting (cycle.py).
    draft_q: torch.Tensor | None = None
    branches: list[Branch] = field(default_factory=list)  # pre-drafted for the verify in flight
    branch_logits: torch.Tensor | None = None  # [num_branches, B, V]
    faults: int = 0  # drafter faults charged to this request (MAX_DRAFTER_FAULTS: no more drafts)
    # The request's grammar (the host's, advanced by the host after each cycle): drafts are
    # steered inside it (grammar.py, Constraint.steer). None: free text.
    constraint: Constraint | None = None
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # copies from `tokens` (lookup.py)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def clear_drafts(self) -> None:
        self.draft, self.draft_q, self.branches, self.branch_logits = None, None, [], None
