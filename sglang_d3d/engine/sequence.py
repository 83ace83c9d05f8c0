"""Per-request decoding state inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang_d3d.engine.api import GenerationRequest
from sglang_d3d.speculative.branches import Branch
from sglang_d3d.speculative.sampling import RequestRandom
from sglang_d3d.speculative.stats import RequestStats


@dataclass
class Sequence:
    req: GenerationRequest
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt + accepted output
    num_prompt: int = 0
    prefilled: int = 0  # prompt tokens in the target's cache (chunked prefill)
    prefill_start: float = 0.0  # perf_counter when its first chunk ran
    generator: RequestRandom | None = None  # per-device seeded streams (speculative/sampling.py)
    stats: RequestStats = field(default_factory=RequestStats)
    submit_time: float = field(default_factory=time.monotonic)
    # Drafter state. `pending`: accepted tokens the drafter cache has not seen yet.
    pending: list[int] = field(default_factory=list)
    draft: list[int] | None = None  # drafts for the next verify
    # [G+1, V] drafter distributions of those slots; None with a draft: a placeholder draft
    # (drafter unavailable), proposed with probability one (engine/drafting.py).
    draft_q: torch.Tensor | None = None
    branches: list[Branch] = field(default_factory=list)  # pre-drafted for the verify in flight
    branch_logits: torch.Tensor | None = None  # [num_branches, B, V]
    drafter_faults: int = 0
    last_cycle: tuple[int, int, bool | None] | None = None  # (drafts, accepted, branch hit)
    finish_reason: str | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def params(self):
        return self.req.params

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.num_prompt

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.num_generated
