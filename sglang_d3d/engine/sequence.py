"""One request inside the engine: its tokens, cache slot, random streams and stats. What only
drafting needs lives in drafting (speculative/draft_state.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sglang_d3d.api import GenerationRequest
from sglang_d3d.engine.adaptive import AcceptCounts
from sglang_d3d.speculative.grammar import Constraint
from sglang_d3d.speculative.sampling import RequestRandom
from sglang_d3d.speculative.stats import RequestStats


@dataclass
class Sequence:
    req: GenerationRequest
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt + accepted output
    num_prompt: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: its stop ids, and EOS unless ignored
    prefilled: int = 0  # prompt tokens in the target's cache (chunked prefill)
    prefill_start: float = 0.0  # perf_counter when its first chunk ran
    generator: RequestRandom | None = None  # per-device seeded streams (speculative/sampling.py)
    constraint: Constraint | None = None  # its grammar's state (structured output)
    stats: RequestStats = field(default_factory=RequestStats)
    accept: AcceptCounts = field(default_factory=AcceptCounts)  # for the adaptive controller
    submit_time: float = field(default_factory=time.monotonic)
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
