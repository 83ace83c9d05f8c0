"""One speculative cycle, for both hosts (the embedded engine and the SGLang worker):

    draft      synchronous drafts for rows with none ready (drafter, on this thread)
    verify     the host's target scores [last token, drafts] and accepts  } at the
    pre-draft  the drafter pre-drafts the next block for likely outcomes  } same time
    follow     the drafter commits the hit branch or queues the new tokens
    -> one `Outcome` per row: tokens to emit, stats, timings

The host keeps its own books from the outcomes (emit, stats, timeline); nothing here writes to
the host's request objects. The target runs on the caller's thread; the pre-draft runs on the
`Executor`'s thread, so the two passes overlap (executor.py). Drafter work the target waits for
anyway runs on the caller's thread with every core, on the drafter's stream (`Executor.run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from sglang_d3d.speculative.draft_state import DraftState
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor
from sglang_d3d.speculative.listeners import Listeners
from sglang_d3d.speculative.stats import CycleStats, RequestStats
from sglang_d3d.speculative.timeline import CycleTimes
from sglang_d3d.speculative.tree import DraftTree, chain_accepted

COPY_LABEL = "copy"  # how a cycle of copies is named and labelled


class Plan(NamedTuple):
    """One cycle's shape: `block` tokens per verify (1 = plain decoding), and whether the
    drafter pre-drafts the next block while the target verifies. A named tuple, so that
    hashing and comparing one runs in C: the controller looks plans up in its tables about a
    hundred times a cycle (`benchmarks/bench_cycle_overhead.py` times its share)."""

    block: int
    overlap: bool = False
    copies: bool = False  # a cycle of copies without a drafter pass (`COPIES`), nobody's plan

    @property
    def name(self) -> str:
        """'1' for plain decoding, '8' for block 8, '8o' for block 8 pre-drafted while
        verifying, 'copy' for a cycle of copies: how calibration, logs and benchmarks name it."""
        if self.copies:
            return COPY_LABEL
        return f"{self.block}{'o' if self.overlap else ''}"

    @property
    def block_label(self) -> str:
        """The metrics' `block` label: the block, or 'copy' (a cycle of copies has none)."""
        return COPY_LABEL if self.copies else str(self.block)

    @classmethod
    def from_labels(cls, block: str, predraft: bool) -> Plan:
        """The plan a metrics sample labelled (block, predraft) counts: `block_label`'s inverse."""
        return COPIES if block == COPY_LABEL else cls(int(block), predraft)

    def verifies_trees(self, tree_nodes: int) -> bool:
        """Whether its cycles verify token trees of `tree_nodes` drafts: there are drafts, and
        no pre-drafting (whose branches are outcomes of a chain)."""
        return tree_nodes > 0 and self.block > 1 and not self.overlap


@dataclass(frozen=True)
class Proposing:
    """What a cycle puts to the target besides its plan's chains of drafts; the embedded
    engine sets it per cycle (engine/proposals.py `Proposals.for_cycle`), the SGLang worker
    verifies whole chains."""

    cutoff: float = 0.0  # verify drafts while the drafter's confidence holds (draft_length.py)
    tree_nodes: int = 0  # verify token trees of this many drafts where the rows allow (tree.py)
    lookup: int = 0  # ... and up to this many more copied from the row's text (lookup.py)
    # per row: a run copied from its text to verify in place of drafting ([]: draft), proposed
    # surely; taken where the cycle verifies trees only; (): no row copies
    copies: tuple[list[int], ...] = ()


# What plan listeners are told a cycle of copies (`run_copy_cycle`) was: the controller never
# chooses it, but its time is decoding time, and a share of time by plan must count it.
COPIES = Plan(0, copies=True)


class Row(Protocol):
    """What the cycle reads of a host's request: its cache slot (the drafter's and the
    target's) and the token the next verify block starts with."""

    slot: int

    @property
    def last_token(self) -> int: ...


@dataclass(frozen=True)
class Verdict:
    """The target's word on one row's block, from the host's `verify_fn`."""

    accepted: int = 0  # drafts accepted
    token: int = 0  # the target's own next token (a correction, or the bonus)
    logits: torch.Tensor | None = None  # [accepted + 1, V] rows that scored the emitted tokens
    error: str | None = None  # this row's verification failed (it alone)
    path: tuple[int, ...] | None = None  # a tree's accepted drafts (a chain's: its first ones)


# (rows, tokens [N, B]: last token then drafts, proposals [N]: drafter probs [>=B-1, V] or None
# for drafts proposed surely[, trees [N]: the drafts as token trees, speculative/tree.py])
# -> one Verdict per row. Hosts that verify chains only are never given trees.
VerifyFn = Callable[..., list[Verdict]]


@dataclass(frozen=True)
class Outcome:
    """One row's cycle."""

    tokens: list[int]  # to emit: accepted drafts, then the target's token ([] on error)
    stats: CycleStats | None  # None where verification failed
    faults: int  # drafter faults charged to this row during the cycle
    times: CycleTimes  # the whole cycle's (shared by its rows)
    logits: torch.Tensor | None = None  # Verdict.logits
    error: str | None = None
    # a tree cycle: (drafts of the top-1 chain, how many of them the chain would have had
    # accepted), so acceptance rates stay the chain's whichever way a block was verified
    chain: tuple[int, int] | None = None


def run_cycle(
    rows: Sequence[Row],
    drafting: Drafting | None,  # None: target-only decoding
    verify_fn: VerifyFn,
    executor: Executor,
    plan: Plan,
    step: int = 0,
    draft_threads: int | None = None,  # intra-op threads for drafting the target waits for
    proposing: Proposing = Proposing(),
) -> list[Outcome]:
    t0 = time.perf_counter()
    cutoff, tree_nodes, lookup = proposing.cutoff, proposing.tree_nodes, proposing.lookup
    times = CycleTimes(step=step, batch=len(rows), block=plan.block)
    states = [drafting.states[r.slot] for r in rows] if drafting is not None else []
    faults = [s.faults for s in states]
    drafted = bool(states) and plan.block > 1
    # (branches in flight would make Drafting.trees fall back to chains, which copies of
    # another length than the block cannot join; a cycle without pre-drafting has none)
    trees_on = drafted and plan.verifies_trees(tree_nodes) and not any(s.branches for s in states)
    copies = list(proposing.copies) or [[]] * len(rows)
    copying = [bool(c) and trees_on for c in copies]
    # draft: rows without a ready draft (a pre-drafted branch that hit) draft now
    if drafted:
        own = [s for s, c in zip(states, copying, strict=True) if not c]
        executor.run(drafting.ensure_drafts, own, plan.block, threads=draft_threads)
        drafting.cut(own, cutoff)
        for s, c, copy in zip(states, copying, copies, strict=True):
            if c:
                s.draft, s.draft_q = list(copy), None
    trees = drafting.trees(states, tree_nodes, lookup) if trees_on else None
    times.draft_end = time.perf_counter() - t0
    drafts = [list(s.draft) for s in states] if drafted else [[] for _ in rows]
    proposals = [s.draft_q for s in states] if drafted else [None] * len(rows)
    sent = [list(t.tokens) for t in trees] if trees else drafts
    tokens = torch.tensor([[r.last_token] + d for r, d in zip(rows, sent)], dtype=torch.int64)
    # verify on this thread, pre-drafting the next block on the executor at the same time
    predraft = None
    if drafted and plan.overlap:
        predraft = executor.submit(drafting.predraft, states, plan.block)
    v0 = time.perf_counter()
    verdicts = verify_fn(rows, tokens, proposals, trees) if trees else verify_fn(rows, tokens, proposals)
    times.verify_start, times.verify_end = v0 - t0, time.perf_counter() - t0
    if predraft is not None:
        _, p0, p1 = predraft.result()
        times.predraft_start, times.predraft_end = p0 - t0, p1 - t0
    # accept: the drafter follows each verified outcome (commits a hit branch, or queues)
    hits = [None] * len(rows)
    if states:
        hits, _, _ = executor.run(_follow, drafting, states, verdicts, plan.block)
    times.hits, times.misses = hits.count(True), hits.count(False)
    times.end = time.perf_counter() - t0
    new_faults = [s.faults - f for s, f in zip(states, faults)] or [0] * len(rows)
    rows_trees = trees or [None] * len(rows)
    return [_outcome(*row, times, copied=c)
            for *row, c in zip(drafts, verdicts, hits, new_faults, rows_trees, copying, strict=True)]


def run_copy_cycle(
    rows: Sequence[Row],
    drafting: Drafting,
    verify_fn: VerifyFn,
    copies: list[list[int]],  # [N][<=L] each row's run copied from its text (lookup.py, or
    # an earlier request's, shared_lookup.py, which may end sooner)
    step: int = 0,
    trees: list[DraftTree] | None = None,  # [N] of one size: verify these instead (below)
) -> list[Outcome]:
    """A cycle without a drafter pass: every row's block is a run copied from its own text,
    proposed surely (a point mass, as a placeholder draft is), so verification stays exact.
    `trees`: sure nodes verified as token trees, each holding its row's copy first: a
    sampled row's copy alone (tree.sure_chain), as it verifies its copy in a cycle of trees,
    so that its draws are the same either way; a greedy row's with other texts' guesses
    beside it (tree.sure_trie). The drafter reads the accepted tokens the next time it
    drafts."""
    t0 = time.perf_counter()
    width = max(t.size for t in trees) if trees else max(map(len, copies))
    times = CycleTimes(step=step, batch=len(rows), block=width + 1)
    copies = copies if trees else [padded(c, width) for c in copies]
    sent = [list(t.tokens) for t in trees] if trees else copies
    tokens = torch.tensor([[r.last_token, *c] for r, c in zip(rows, sent)], dtype=torch.int64)
    times.draft_end = times.verify_start = time.perf_counter() - t0
    none = [None] * len(rows)
    verdicts = verify_fn(rows, tokens, none, trees) if trees else verify_fn(rows, tokens, none)
    times.verify_end = time.perf_counter() - t0
    for r, c, v in zip(rows, copies, verdicts, strict=True):
        if v.error is None:
            done = list(v.path) if v.path is not None else c[: v.accepted]
            drafting.skip(drafting.states[r.slot], [*done, v.token])
    times.end = time.perf_counter() - t0
    return [_outcome(c, v, None, 0, t, times, copied=True)
            for c, v, t in zip(copies, verdicts, trees or [None] * len(rows), strict=True)]


def padded(run: list[int], width: int) -> list[int]:
    """A copied run made `width` long by repeating its last token, so the rows of one verify
    pass are alike. The target accepts a repeat only where it would have produced that token
    itself (a greedy row's chain: sampled rows' copies go as trees, `tree.pad`)."""
    return run + run[-1:] * (width - len(run))


def _follow(drafting: Drafting, states: list[DraftState], verdicts: list[Verdict], block: int):
    """Bring the drafter up to date with each verified row. -> branch hit/miss/None per row."""
    hits: list[bool | None] = []
    for s, v in zip(states, verdicts, strict=True):
        if v.error is not None:
            hits.append(None)
        elif block > 1:
            hits.append(drafting.advance(s, v.accepted, v.token, block, v.path))
        else:  # a cycle without drafts
            drafting.skip(s, [v.token])
            hits.append(None)
    return hits


def _outcome(draft: list[int], v: Verdict, hit, faults: int, tree: DraftTree | None,
             t: CycleTimes, copied: bool = False) -> Outcome:
    """`draft`: the row's chain; `tree`: the tree verified instead, if any. A tree cycle's
    stats count the positions it tested (its depth), and it says what its top-1 chain would
    have had accepted."""
    if v.error is not None:
        return Outcome([], None, faults, t, error=v.error)
    draft_time = t.draft_end + (t.predraft_end - t.predraft_start)
    tested, nodes = (tree.depth, tree.size) if tree else (len(draft), 0)
    stats = CycleStats(tested, v.accepted, hit, draft_time, t.verify_end - t.verify_start,
                       t.end, t.overlap, nodes, copied)
    done = list(v.path) if v.path is not None else draft[: v.accepted]
    chain = (len(draft), chain_accepted(draft, done, v.token)) if tree else None
    return Outcome(done + [v.token], stats, faults, t, v.logits, chain=chain)


def record(request_id: str, stats: RequestStats, o: Outcome, listeners: Listeners) -> None:
    """Fold one row's outcome into its request's stats, and hand it to the cycle listeners
    (fn(request_id, CycleStats): the Prometheus recorder)."""
    stats.fallbacks += o.faults
    if o.stats is None:
        return
    stats.add_cycle(o.stats)
    listeners.notify(request_id, o.stats)
