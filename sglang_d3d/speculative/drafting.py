"""Drafting, for both hosts: synchronous drafts, asynchronous branches, and what to do after
verification (commit a hit branch, or fall back to a synchronous draft on a miss). Each request's
drafting state is a `DraftState` (draft_state.py) that drafting creates and alone writes.

Drafter faults never cost tokens: a failing or garbage-producing drafter leaves the row with a
placeholder draft whose proposal distribution is a point mass. Verification against a point
mass is still exact (greedy: it is just compared; sampling: accepted with probability p(x), else
the residual), so the request carries on target-only until the drafter recovers. A fault is
charged to the request that caused it: a failed batched pass is retried row by row, so one bad
request never costs the others their drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sglang_d3d.config import BranchPolicy, SamplingParams, SpecConfig
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.kv_cache import KVCache
from sglang_d3d.models.packing import branch_pack, extend_pack
from sglang_d3d.speculative.branches import match_branch, select_branches
from sglang_d3d.speculative.draft_length import batch_length, confident_length, row_confidences
from sglang_d3d.speculative.draft_state import DraftState
from sglang_d3d.speculative.grammar import Constraint
from sglang_d3d.speculative.lookup import CopySource
from sglang_d3d.speculative.sampling import RequestRandom, draw_drafts, usable
from sglang_d3d.speculative.tree import DraftTree, build_tree, graft, pad, sure_chain
from sglang_d3d.speculative.tree_sampling import sample_tree

log = logging.getLogger(__name__)
MAX_DRAFTER_FAULTS = 3  # after this many, a request stops using the drafter
PREFILL_OVER = 64  # pending tokens beyond which the drafter reads them by causal prefill


def draft_cache_len(context: int, block: int, drafter_block: int, num_branches: int) -> int:
    """Drafter cache rows a slot needs: the context, then scratch for one pack of the drafts
    under verification plus `num_branches` pre-drafted blocks, each of the pack block size
    (drafter_block: the drafter's smallest trained block, DrafterConfig.smallest_block)."""
    pack = max(block, drafter_block)
    return context + pack * (1 + num_branches)


def max_branches(spec: SpecConfig) -> int:
    """The most branches one verify can have pre-drafted (every outcome, every guess)."""
    return spec.num_outcomes * spec.guesses_per_position


class DrafterFault(RuntimeError):
    """The drafter raised or produced unusable output."""


class Drafting:
    def __init__(self, runner: DraftRunner, spec: SpecConfig, prefill_chunk: int = 64,
                 max_prefill: int = 1024, target_cache: KVCache | None = None) -> None:
        self.runner = runner
        self.spec = spec
        self.prefill_chunk, self.max_prefill = prefill_chunk, max_prefill
        self.states: dict[int, DraftState] = {}  # by drafter cache slot
        # A full-depth drafter's prefix cache is the target's (clean tokens run the target's
        # layers unchanged), so the tokens it has not read yet, except the newest (which the
        # target has not read either), are copied from the target's cache instead of being
        # computed: the prompt after prefill, accepted drafts, plain-decoding cycles.
        self.target_cache = target_cache if runner.model.is_full_depth else None

    @classmethod
    def create(cls, drafter: D3DDrafter, num_slots: int, context: int, spec: SpecConfig,
               prefill_chunk: int = 64, max_prefill: int = 1024,
               target_cache: KVCache | None = None, int8: bool = False,
               input_bits: int = 8) -> Drafting:
        """Drafting with a drafter cache of `num_slots` rows, each sized for `context` tokens
        plus the scratch of one cycle under `spec`. `target_cache`: the target's slot cache
        (same slots and positions), which a full-depth drafter copies its prefix from; None
        where the host's target cache has another layout (SGLang's paged pool). `int8`: the
        drafter's passes on int8 weights (models/int8_linear.py). `input_bits`: 8 or 14, what
        its passes on a 4-bit target's C++ loop keep of their projections' inputs
        (EngineConfig.draft_input_bits)."""
        size = draft_cache_len(context, spec.block_size, drafter.cfg.smallest_block,
                               max_branches(spec))
        runner = DraftRunner(drafter, num_slots, size, int8=int8, coarse=input_bits == 8)
        return cls(runner, spec, prefill_chunk, max_prefill, target_cache)

    # ---- requests ---------------------------------------------------------------------------
    def start(self, slot: int, tokens: list[int], params: SamplingParams,
              generator: RequestRandom | None, constraint: Constraint | None = None) -> DraftState:
        """A request enters `slot` with `tokens` so far; the first draft reads them all.
        `constraint`: its grammar, which the host advances with every token it emits."""
        self.runner.reset(slot)  # the slot may hold a finished request's tokens
        self.states[slot] = DraftState(slot, params, generator, list(tokens), list(tokens),
                                       constraint=constraint)
        return self.states[slot]

    def restart(self, s: DraftState, tokens: list[int]) -> None:
        """The request's history was rewritten: forget the cache and read `tokens` afresh."""
        self.runner.reset(s.slot)
        s.tokens, s.pending = list(tokens), list(tokens)
        s.clear_drafts()

    def release(self, slot: int) -> None:
        self.states.pop(slot, None)
        self.runner.reset(slot)

    # ---- before verify ----------------------------------------------------------------------
    def ensure_drafts(self, rows: list[DraftState], block: int) -> None:
        """Give every row `block - 1` drafts: a synchronous draft where none is ready."""
        for s in rows:
            if s.draft is not None and len(s.draft) < block - 1:
                s.draft = None  # drafted for a smaller block
        need = [s for s in rows if s.draft is None and s.faults < MAX_DRAFTER_FAULTS]
        alone = all(len(s.pending) > PREFILL_OVER for s in rows)  # nobody else would wait
        if need:
            self._guard_each(need, lambda part: self._sync_draft(part, block, alone))
        for s in rows:
            if s.draft is None:
                _placeholder(s, block)
            s.draft = s.draft[: block - 1]
            if s.draft_q is not None:
                s.draft_q = s.draft_q[:block]

    def cut(self, rows: list[DraftState], cutoff: float) -> None:
        """Verify only the drafts worth it (draft_length.py): every row's drafts are cut to
        the longest confident run in the batch (one verify pass, one block length). The
        proposals q keep their rows: q after the last draft kept is the drafter's guess at the
        bonus token, which is what pre-drafting's full-acceptance branch needs."""
        if cutoff <= 0 or not rows:
            return
        wanted = [None if s.draft_q is None else
                  confident_length(row_confidences(s.draft, s.draft_q, s.params.greedy), cutoff)
                  for s in rows]
        keep = batch_length(wanted, len(rows[0].draft))
        for s in rows:
            s.draft = s.draft[:keep]

    def _sync_draft(self, rows: list[DraftState], block: int, alone: bool = True) -> None:
        rows = [s for s in rows if s.draft is None]  # a retry skips rows already drafted
        for s in rows:
            if not s.pending:  # cache up to date (a hit's draft was dropped): re-read the anchor
                self.runner.rollback(s.slot, 1)
                s.pending = [s.last_token]
        self._adopt(rows)
        self._catch_up(rows, self.max_prefill if alone else self.prefill_chunk)
        rows = [s for s in rows if len(s.pending) <= PREFILL_OVER]
        if not rows:
            return
        packs = [(s.slot, extend_pack(s.pending, self.pack_block(block))) for s in rows]
        logits = self.runner.run(packs)
        for s in rows:
            s.pending = []  # committed by the pass, whatever happens to the drafts below
        for s, lg in zip(rows, logits):
            _set_draft(s, _checked(lg[0]))

    def _adopt(self, rows: list[DraftState]) -> None:
        """Copy the entries of every pending token but the newest from the target's cache
        (only before verification, while the target's cache is not being written)."""
        if self.target_cache is None:
            return
        for s in rows:
            if len(s.pending) > 1:
                self.runner.adopt(s.slot, self.target_cache, len(s.pending) - 1)
                s.pending = s.pending[-1:]

    def _catch_up(self, rows: list[DraftState], budget: int) -> None:
        """Long pending tokens (a prompt) are read by causal prefill, at most `budget` tokens
        per cycle: a chunk while other requests decode (they wait for the drafter), all at once
        when nobody else would wait. A row still catching up decodes this cycle with a
        placeholder draft, which keeps verification exact (read whole, a 3k-token prompt's first
        draft stalled every stream for seconds)."""
        for s in rows:
            n = min(budget, len(s.pending) - 1)
            if len(s.pending) <= PREFILL_OVER or n <= 0:
                continue
            self.runner.prefill(s.slot, s.pending[:n])
            s.pending = s.pending[n:]
            budget -= n

    def predraft(self, rows: list[DraftState], block: int) -> None:
        """Pre-draft the next block for the likely outcomes of the verify in flight."""
        rows = [s for s in rows if s.draft_q is not None]  # no branches for placeholders
        if not rows:
            return
        self._guard_each(rows, lambda part: self._predraft_rows(part, block))

    def _predraft_rows(self, rows: list[DraftState], block: int) -> None:
        for s in rows:
            s.branches = select_branches(
                s.draft, s.draft_q, self.spec.branch_policy, self._budget(block),
                self.spec.guesses_per_position,
            )
        packs = [
            (s.slot, branch_pack(s.draft, [(b.num_accepted, b.token) for b in s.branches],
                                 self.pack_block(block)))
            for s in rows
        ]
        self._store_branches(rows, self.runner.run(packs))

    def _store_branches(self, rows: list[DraftState], logits: list[torch.Tensor]) -> None:
        for s, lg in zip(rows, logits):
            s.branch_logits = _checked(lg)

    def pack_block(self, block: int) -> int:
        return self.runner.model.cfg.pack_block(block)

    def _budget(self, block: int) -> int:
        if self.spec.branch_policy is BranchPolicy.ALL:
            return block * self.spec.guesses_per_position
        return self.spec.branch_budget

    def trees(self, rows: list[DraftState], nodes: int, lookup: int = 0) -> list[DraftTree] | None:
        """Every row's drafts as a token tree of `nodes` drafts (speculative/tree.py), or None
        (verify chains) where trees are off or a row has branches in flight. One verify pass
        has one shape: smaller trees are padded with repeats that are never accepted
        (tree.pad). A greedy row's tree holds the drafter's likeliest paths, and up to
        `lookup` more guesses copied from its own text (lookup.py) grafted under its first
        draft; a sampled row's has the drafter's shape, filled with draws
        (tree_sampling.py), its chain's drafts first, and its copies as nodes proposed with
        probability one. Where any row found a copy, every greedy row's tree grows by
        `lookup` drafts (the others' from the drafter); a sampled row's only by its own copy,
        so that what it draws never depends on its batch (a seed gives the same output alone
        and batched). A row whose drafts are proposed surely (a placeholder, or a run copied
        in place of drafting, `copy_of`) verifies them as a chain of sure nodes
        (tree.sure_chain), so it does not turn its batch's trees into chains."""
        if nodes <= 0 or not rows or any(not s.draft or s.branches for s in rows):
            return None
        copies = [_copied(s, lookup) if s.draft_q is not None else [] for s in rows]
        trees = [sure_chain(s.draft) if s.draft_q is None else
                 self._tree(s, _size(s, c, nodes, lookup, any(copies)), c)
                 for s, c in zip(rows, copies, strict=True)]
        return [pad(t, max(t.size for t in trees)) for t in trees]

    @staticmethod
    def copy_of(s: DraftState, length: int, min_ngram: int,
                elsewhere: Sequence[CopySource] = ()) -> list[int]:
        """The row's next `length` tokens copied from its own text (lookup.py), or for a
        greedy row where that has none, from the first of `elsewhere` that has one (earlier
        requests' text, shared_lookup.py; the drafter's corpus, corpus_lookup.py), to verify
        in place of drafting: [] where it has a draft ready (a pre-drafted branch that hit
        costs nothing more), `length` or `min_ngram` is 0, or no copy's match is `min_ngram`
        tokens long."""
        if length <= 0 or min_ngram <= 0 or s.draft is not None:
            return []
        own = s.ngrams.continuation(s.tokens, length, min_ngram)
        if own or not s.params.greedy:
            return own
        for source in elsewhere:
            copied = source.continuation(s.tokens, length)
            if copied:
                return copied
        return []

    @staticmethod
    def copy_guesses(s: DraftState, copy: list[int], length: int,
                     elsewhere: Sequence[CopySource], nodes: int) -> list[list[int]]:
        """A greedy row's copy (`copy_of`) first, then every other text's guesses of what
        follows it (at most `length` deep, about `nodes` from each source), for a cycle of
        copies that verifies them as one tree (tree.sure_trie): where the texts disagree, the
        target keeps whichever it would have said. Its own text gives one copy, the latest."""
        paths = [copy]
        for source in elsewhere if nodes > 0 else ():
            paths += source.guesses(s.tokens, length, nodes)
        return paths

    @staticmethod
    def copies(rows: list[DraftState], length: int, min_ngram: int,
               elsewhere: Sequence[CopySource] = ()) -> list[list[int]] | None:
        """Every row's copy (`copy_of`, `elsewhere` where its own text has none) for a cycle
        without a drafter pass, verified as chains; None unless every row is greedy and found
        one. Hosts that verify chains only (the SGLang worker) keep sampled rows out: whether
        a cycle copies would depend on every row of the batch, and a sampled row's draws must
        not (the engine verifies a sampled row's copies as a tree of sure nodes, alone or
        batched)."""
        out = Drafting.row_copies(rows, length, min_ngram, elsewhere)
        return out if out and all(out) else None

    @staticmethod
    def row_copies(rows: list[DraftState], length: int, min_ngram: int,
                   elsewhere: Sequence[CopySource] = (), sampled_too: bool = False) -> list[list[int]]:
        """Per row, its copy (`copy_of`; []: none). A greedy row's copy serves only a cycle of
        copies, which needs every row to have one: once a row has none, the greedy rows after
        it skip the lookup (O(context), every row, every cycle). A sampled row copies only
        where `sampled_too`: the host verifies its copy alone, as a chain of sure nodes among
        the batch's trees, so that what it draws never depends on its batch."""
        out, whole = [], True  # whole: every row so far has a copy
        for s in rows:
            wanted = sampled_too if not s.params.greedy else whole
            out.append(Drafting.copy_of(s, length, min_ngram, elsewhere) if wanted else [])
            whole = whole and bool(out[-1])
        return out

    @staticmethod
    def _tree(s: DraftState, nodes: int, copied: list[int]) -> DraftTree:
        q = s.draft_q[: len(s.draft)]  # [D, V]
        tree = build_tree(q, nodes)
        sampled = not s.params.greedy
        if sampled:  # the greedy tree's shape, filled with draws
            tree = sample_tree(tree, s.draft, q, s.generator)
        return graft(tree, copied, nodes, sure=sampled) if copied else tree

    # ---- after verify -----------------------------------------------------------------------
    def advance(self, s: DraftState, accepted: int, token: int, block: int,
                path: tuple[int, ...] | None = None) -> bool | None:
        """Bring the drafter up to date with the verified outcome. -> branch hit/miss/None.
        `path`: the accepted drafts where the block was a tree (else the first `accepted`).
        A fault here costs this request its drafter cache (rebuilt from its tokens), never its
        tokens and never another request's drafts."""
        done = list(path) if path is not None else list(s.draft or [])[:accepted]
        run = done + [token]
        try:
            hit = self._follow(s, done, token, block)
        except Exception as e:  # noqa: BLE001 - any drafter failure degrades, never fails
            self._fault([s], e)
            s.pending.extend(run)  # _reset queued the tokens before this cycle's run
            s.draft, s.draft_q = None, None
            hit = None
        s.tokens.extend(run)
        return hit

    def _follow(self, s: DraftState, done: list[int], token: int, block: int) -> bool | None:
        """`done`: the drafts accepted (a tree's path, or the chain's first ones)."""
        accepted, hit_index = len(done), None
        had_branches = s.branch_logits is not None and bool(s.branches)
        if had_branches:  # branches are outcomes of a chain, and trees are never pre-drafted
            hit_index = match_branch(s.branches, accepted, token)
        if hit_index is not None:
            self.runner.commit_branch(s.slot, len(s.draft), hit_index, accepted,
                                      self.pack_block(block))
            _set_draft(s, s.branch_logits[hit_index], after=[*done, token])
        elif had_branches:
            self.runner.commit(s.slot, accepted)  # d1..dn were written by the branch pass
            s.pending.append(token)
            s.draft = None
        else:
            s.pending.extend(done)
            s.pending.append(token)
            s.draft = None
        s.branches, s.branch_logits = [], None
        return None if not had_branches else hit_index is not None

    def skip(self, s: DraftState, new_tokens: list[int]) -> None:
        """Tokens came without the drafter (a cycle without drafts, or the host's own record):
        remember what it has not seen."""
        s.tokens.extend(new_tokens)
        s.pending.extend(new_tokens)
        s.draft, s.branches, s.branch_logits = None, [], None

    # ---- faults -----------------------------------------------------------------------------
    def _guard_each(self, rows: list[DraftState], fn) -> None:
        """fn(rows) as one batch; if that faults, fn([row]) for each row, so only the rows that
        fault on their own are charged. Safe to retry: a pass advances the drafter's committed
        lengths only after it has run."""
        try:
            fn(rows)
        except Exception as e:  # noqa: BLE001 - any drafter failure degrades, never fails
            if len(rows) == 1:
                self._fault(rows, e)
                return
            log.warning("drafter fault in a batch of %d, retrying per request: %s", len(rows), e)
            for s in rows:
                self._guard([s], lambda s=s: fn([s]))

    def _guard(self, rows: list[DraftState], fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any drafter failure degrades, never fails
            self._fault(rows, e)

    def _fault(self, rows: list[DraftState], e: Exception) -> None:
        log.warning("drafter fault on %d request(s): %s", len(rows), e)
        for s in rows:
            self._reset(s)

    def _reset(self, s: DraftState) -> None:
        s.faults += 1
        self.runner.reset(s.slot)
        s.pending = list(s.tokens)  # rebuild the drafter cache from scratch next time
        # A draft already under verification stays: only the drafter's own state is dropped.
        s.branches, s.branch_logits = [], None


def _size(s: DraftState, copied: list[int], nodes: int, lookup: int, batch_copies: bool) -> int:
    """A row's tree size: `nodes`, and `lookup` more where it found a copy, or, for a greedy
    row, where any row did (one verify shape; the drafter's next likeliest nodes are free)."""
    grows = copied or (s.params.greedy and batch_copies)
    return nodes + (lookup if grows else 0)


def _copied(s: DraftState, lookup: int) -> list[int]:
    """A row's guesses copied from its own text after its first draft (a sampled row's are
    proposed with probability one: tree_sampling.py), from the row's n-gram index."""
    return s.ngrams.continuation_after(s.tokens, s.draft[0], lookup)


def _checked(logits: torch.Tensor) -> torch.Tensor:
    if not usable(logits):
        raise DrafterFault("drafter produced non-finite logits")
    return logits


def _set_draft(s: DraftState, slot_logits: torch.Tensor, after: Sequence[int] = ()) -> None:
    """slot_logits [B, V] -> drafts (the last slot only guesses the bonus) and q [B, V].
    `after`: tokens the host has not emitted yet (a hit branch's run), before the slots."""
    if s.constraint is not None:
        slot_logits = s.constraint.steer(slot_logits, after)
    tokens, s.draft_q = draw_drafts(slot_logits, s.params, s.generator)
    s.draft = tokens[:-1]


def _placeholder(s: DraftState, block: int) -> None:
    """Drafts that are the last token repeated, proposed with probability one (exact)."""
    s.draft = [s.last_token] * (block - 1)
    s.draft_q = None  # the mark of a placeholder: verify_draft's point-mass proposal
