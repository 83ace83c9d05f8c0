"""Fused speculation: the target verifies block k and the drafter drafts block k+1 in the same
forward pass (models/fused_runner.py), for the embedded engine with a full-depth drafter.

    pass    per row: [last token, drafts] (the target's verify block) and, for the likeliest
            outcomes "j drafts accepted", B-1 masks anchored at the j-th verify token
    accept  the host accepts n drafts and the target's own token c, as in every cycle
    follow  a branch anchored at n has already predicted the tokens after c: they are the next
            cycle's drafts (a hit). On a miss the next cycle verifies c alone, with one branch
            anchored at it, which always hits.

Asynchronous drafting (drafting.py) pre-drafts "rejection at j with a guessed correction", and
hits only when both guesses are right. Here the branch is anchored at the last accepted draft
itself, so no token is guessed and it hits whenever its outcome happens; the price is that
the block's first draft is a two-ahead prediction, where a synchronous draft's first is the
target's own. The weights are read once per cycle instead of twice, which is what a
memory-bound pass costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_d3d.config import SamplingParams, SpecConfig
from sglang_d3d.models.fused_runner import FusedRunner
from sglang_d3d.models.packing import fused_pack
from sglang_d3d.speculative.cycle import Outcome, Plan, Row, Verdict
from sglang_d3d.speculative.sampling import RequestRandom, draw_drafts, usable
from sglang_d3d.speculative.stats import CycleStats
from sglang_d3d.speculative.timeline import CycleTimes

MAX_FAULTS = 3  # after this many unusable branch outputs, a request decodes target-only


def outcome_probs(keep: list[float]) -> list[float]:
    """keep[i]: the drafter's probability of its own draft i+1 (G of them). -> P(exactly n
    drafts accepted) for n = 0..G, if each draft stands as the drafter believes."""
    out, prefix = [], 1.0
    for a in keep:
        out.append(prefix * (1.0 - a))
        prefix *= a
    return out + [prefix]


def choose_anchors(keep: list[float], budget: int) -> list[int]:
    """The `budget` likeliest outcomes (verify indices 0..G), in index order."""
    probs = outcome_probs(keep)
    best = sorted(range(len(probs)), key=lambda n: -probs[n])[:budget]
    return sorted(best)


@dataclass
class FusedState:
    """One request's drafts as fused drafting keeps them."""

    slot: int
    params: SamplingParams
    generator: RequestRandom | None
    draft: list[int] = field(default_factory=list)  # for the next verify
    draft_q: torch.Tensor | None = None  # [G, V] the drafter's distribution of each draft
    anchors: list[int] = field(default_factory=list)  # of the pass in flight
    faults: int = 0


# (rows, drafts per row, proposals [G, V] or None, verify logits [G+1, V] per row) -> verdicts
AcceptFn = Callable[[Sequence[Row], list[list[int]], list, list[torch.Tensor]], list[Verdict]]


class FusedDrafting:
    def __init__(self, runner: FusedRunner, spec: SpecConfig) -> None:
        self.runner = runner
        self.spec = spec
        self.states: dict[int, FusedState] = {}

    @staticmethod
    def scratch(spec: SpecConfig, smallest_block: int) -> int:
        """Target cache rows a slot needs past its verify block: the branches' masks."""
        return spec.branch_budget * (max(spec.block_size, smallest_block) - 1)

    def start(self, slot: int, tokens: list[int], params: SamplingParams,
              generator: RequestRandom | None, constraint: object = None) -> FusedState:
        """A request starts decoding in `slot` (its tokens are in the target's cache). Its
        grammar (`constraint`) does not steer fused drafts: they are verified under it all
        the same."""
        self.states[slot] = FusedState(slot, params, generator)
        return self.states[slot]

    def release(self, slot: int) -> None:
        self.states.pop(slot, None)

    def pack_block(self, block: int) -> int:
        return self.runner.model.cfg.pack_block(block)

    def cycle(self, rows: Sequence[Row], accept: AcceptFn, plan: Plan, step: int = 0):
        """One fused cycle for every row. -> one `Outcome` per row."""
        t0 = time.perf_counter()
        times = CycleTimes(step=step, batch=len(rows), block=plan.block)
        states = [self.states[r.slot] for r in rows]
        faults = [s.faults for s in states]
        packs = [self._pack(s, r.last_token, plan.block) for s, r in zip(states, rows)]
        out = self.runner.run([(r.slot, p) for r, p in zip(rows, packs)])
        times.verify_end = time.perf_counter() - t0
        drafts = [list(s.draft) for s in states]
        verdicts = accept(rows, drafts, [s.draft_q for s in states], [v for v, _ in out])
        hits = [self._follow(s, v, b) for s, v, (_, b) in zip(states, verdicts, out)]
        # The drafting rode in the verify pass: all of it overlapped verification.
        times.predraft_end = times.verify_end
        times.hits, times.misses = hits.count(True), hits.count(False)
        times.end = time.perf_counter() - t0
        new_faults = [s.faults - f for s, f in zip(states, faults)]
        return [_outcome(*row, times) for row in zip(drafts, verdicts, hits, new_faults, strict=True)]

    def _pack(self, s: FusedState, last_token: int, block: int):
        """This row's verify tokens and branch anchors for a cycle of `block`."""
        s.draft = s.draft[: block - 1]
        if s.draft_q is not None:
            s.draft_q = s.draft_q[: len(s.draft)]
        s.anchors = []
        if block > 1 and s.faults < MAX_FAULTS:
            keep = [] if s.draft_q is None else s.draft_q.gather(
                1, torch.tensor(s.draft, device=s.draft_q.device).unsqueeze(1)).squeeze(1).tolist()
            s.anchors = choose_anchors(keep, self.spec.branch_budget)
        return fused_pack([last_token] + s.draft, s.anchors, self.pack_block(block))

    def _follow(self, s: FusedState, v: Verdict, branches: torch.Tensor) -> bool | None:
        """branches [K, B-1, V]. -> hit / miss / None (no branches this cycle)."""
        anchors, s.anchors = s.anchors, []
        s.draft, s.draft_q = [], None
        if v.error is not None or not anchors:
            return None
        if v.accepted not in anchors:
            return False
        logits = branches[anchors.index(v.accepted)]  # [B-1, V]
        if not usable(logits):
            s.faults += 1  # no drafts this time: the next cycle verifies the token alone
            return False
        s.draft, s.draft_q = draw_drafts(logits, s.params, s.generator)
        return True


def _outcome(draft: list[int], v: Verdict, hit: bool | None, faults: int, t: CycleTimes) -> Outcome:
    if v.error is not None:
        return Outcome([], None, faults, t, error=v.error)
    stats = CycleStats(len(draft), v.accepted, hit, 0.0, t.verify_end, t.end, t.verify_end)
    return Outcome(draft[: v.accepted] + [v.token], stats, faults, t, v.logits)
