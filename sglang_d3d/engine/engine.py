"""The speculative engine: one `step()` = schedule -> prefill or one speculative cycle
(speculative/cycle.py: draft -> verify beside pre-drafting -> accept) -> emit, for every running
request at once.

Modes share everything but the drafting: `ar` verifies no drafts (plain decoding), `sync`
drafts then verifies, `async` also pre-drafts the next block while the target verifies, and
`fused` drafts the next block inside the verify pass itself (speculative/fused.py). The
target runs on the calling thread, the drafter on an `Executor` thread (and CUDA stream).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from sglang_d3d.api import GenerationRequest, RequestTooLongError, TokenEvent
from sglang_d3d.config import EngineConfig, Mode
from sglang_d3d.engine.adaptive import BlockController
from sglang_d3d.engine.copy_arms import CopyArms, Way
from sglang_d3d.engine.proposals import Proposals
from sglang_d3d.engine.scheduler import Scheduler, plan_chunks
from sglang_d3d.engine.sequence import Sequence
from sglang_d3d.models.architectures import check_context
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.fused_runner import FusedRunner
from sglang_d3d.models.int8_linear import use_int8
from sglang_d3d.models.target import TargetRunner
from sglang_d3d.speculative.corpus_lookup import CorpusIndex, corpus_index
from sglang_d3d.speculative.cycle import (
    COPIES,
    Outcome,
    Plan,
    Verdict,
    record,
    run_copy_cycle,
    run_cycle,
)
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor
from sglang_d3d.speculative.fused import FusedDrafting
from sglang_d3d.speculative.grammar import Grammars, constrain
from sglang_d3d.speculative.listeners import Listeners
from sglang_d3d.speculative.logprobs import token_logprobs
from sglang_d3d.speculative.penalties import reshape_chain, reshape_tree
from sglang_d3d.speculative.sampling import make_generator, sample, target_probs
from sglang_d3d.speculative.shared_lookup import TextIndex
from sglang_d3d.speculative.threads import intra_op_threads
from sglang_d3d.speculative.timeline import Timeline
from sglang_d3d.speculative.tree import (
    DraftTree,
    greedy_tree_accept,
    pad,
    path_tokens,
    sure_chain,
    sure_trie,
    tree_inputs,
)
from sglang_d3d.speculative.tree_sampling import sampled_tree_accept
from sglang_d3d.speculative.verify import verify_draft


class SpecEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        target: Decoder,
        drafter: D3DDrafter | None,
        eos_token_ids: tuple[int, ...] = (),  # end every request, on top of its stop ids
        grammars: Grammars | None = None,  # compiles requests' grammars; None: refuses them
    ) -> None:
        if cfg.mode is not Mode.AR and drafter is None:
            raise ValueError(f"mode {cfg.mode.value} needs a drafter")
        cfg = cfg.with_verify_widths(target.rows_apart)  # copies and trees as wide as verify width is cheap
        # A sliding window is honoured by keeping every request inside it.
        check_context(target.arch.sliding_window, cfg.max_context, target.arch.model_type)
        self.cfg = cfg
        self.vocab_size = target.arch.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = grammars
        slots, block = cfg.max_batch_size, cfg.spec.block_size
        fused = cfg.mode is Mode.FUSED
        scratch = FusedDrafting.scratch(cfg.spec, drafter.cfg.smallest_block) if fused else 0
        # a tree may be wider than a block
        verify_width = max(block, cfg.tree_nodes + cfg.lookup_tokens + 1,
                           cfg.lookup_tokens + cfg.copy_guesses + 1)
        self.target = TargetRunner(target, slots, cfg.max_context + verify_width + 1 + scratch)
        self.drafting: Drafting | FusedDrafting | None = None
        if fused:
            self.drafting = FusedDrafting(FusedRunner(drafter, self.target), cfg.spec)
        elif drafter is not None and cfg.mode is not Mode.AR:
            d = drafter.mask_embedding
            self.drafting = Drafting.create(drafter, slots, cfg.max_context, cfg.spec,
                                            cfg.prefill_chunk, cfg.max_prefill_tokens,
                                            self.target.cache,
                                            use_int8(cfg.draft_weights, d.device, d.dtype),
                                            cfg.draft_input_bits)
        self.scheduler = Scheduler(slots, cfg.max_queue)
        # Prefill sharing (_share_prefills): follower id -> leader, leader id -> followers.
        self._leader_of: dict[int, Sequence] = {}
        self._followers: dict[int, list[Sequence]] = {}
        draft_device = self.drafting.runner.device if self._separate_drafter else cfg.device
        self.executor = Executor(draft_device, cfg.draft_threads)
        self.timeline = Timeline()
        self.cycle_listeners = Listeners()  # fn(request_id, CycleStats), per row and cycle
        self.plan_listeners = Listeners()  # fn(batch, Plan, seconds, tokens), once per cycle (COPIES too)
        # Calibration swaps in whole blocks and no cycles of copies for a while (calibrate.py).
        self.proposals = Proposals.of(cfg, self._separate_drafter)
        # Finished requests' texts, for greedy rows' copies (shared_lookup.py); None: off.
        # Calibration sets it aside, so its synthetic text never lands here.
        self.shared_text = (TextIndex(cfg.shared_lookup_tokens)
                            if self.proposals.copy_ngram and cfg.shared_lookup_tokens else None)
        # The target's answers in the drafter's corpus, for greedy rows' copies after those
        # (corpus_lookup.py); None: off, or a drafter without one.
        self.corpus = self._corpus(drafter)
        # How cycles whose rows all found copies run (copy_arms.py); None: no copies.
        self.copy_arms = (CopyArms(guesses=cfg.copy_guesses > 0)
                          if isinstance(self.drafting, Drafting) and self.proposals.copy_ngram
                          else None)
        self.controller = None
        if cfg.adaptive:
            # Fused drafts are two-ahead predictions: the drafter's held-out rates are not theirs.
            prior = drafter.accept_prior if self._separate_drafter else ()
            self.controller = BlockController(self._candidate_plans(), prior=prior)
        self._steps = 0

    @property
    def _separate_drafter(self) -> bool:
        """The drafter runs passes of its own (sync, async), on the executor's device."""
        return isinstance(self.drafting, Drafting)

    def _candidate_plans(self) -> tuple[Plan, ...]:
        s = self.cfg
        if self.drafting is None:
            return (Plan(1),)
        blocks = {s.spec.block_size} | {b for b in (4, 8) if s.min_block_size <= b < s.spec.block_size}
        overlaps = (False, True) if s.mode is Mode.ASYNC else (False,)
        return (Plan(1),) + tuple(Plan(b, o) for b in sorted(blocks) for o in overlaps)

    @property
    def _alone_threads(self) -> int:
        """Intra-op threads for one model running alone: in async mode, both models' share."""
        c = self.cfg
        return c.target_threads + (c.draft_threads if c.mode is Mode.ASYNC else 0)

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; its events come back from `step()`."""
        self.scheduler.add(self._sequence(req))

    def submit_all(self, reqs: list[GenerationRequest]) -> None:
        """Queue several requests at once, or none (a full queue refuses them all). Requests
        with the same prompt admitted in one step share one prefill (`n` > 1 choices)."""
        self.scheduler.add_all([self._sequence(req) for req in reqs])

    def _sequence(self, req: GenerationRequest) -> Sequence:
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in req.prompt_ids):
            raise ValueError("prompt token id out of the vocabulary")
        if any(t >= self.vocab_size for t, _ in req.params.logit_bias):
            raise ValueError("logit_bias token id out of the vocabulary")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.cfg.max_context:
            raise RequestTooLongError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length "
                f"{self.cfg.max_context}"
            )
        seq = Sequence(req=req, tokens=list(req.prompt_ids))
        seq.num_prompt = len(req.prompt_ids)
        eos = frozenset() if req.params.ignore_eos else self.eos_token_ids
        seq.stop_ids = eos.union(req.params.stop_token_ids)
        seq.stats.mode = self.cfg.mode.value
        seq.stats.prompt_tokens = seq.num_prompt
        if req.arrival_time:
            seq.submit_time = req.arrival_time
        seq.generator = make_generator(req.params.seed)
        if req.params.grammar is not None:
            if self.grammars is None:
                raise ValueError("structured output is not available: this engine has no "
                                 "grammar compiler (the xgrammar package, and the tokenizer)")
            seq.constraint = self.grammars.constraint(req.params.grammar)
        return seq

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    # ---- the loop body ----------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for seq in self.scheduler.take_aborted():
            events.append(self._finish(seq, "abort"))
            self._pop_followers(seq)  # they prefill on their own now
        self._share_prefills(self.scheduler.admit())
        live = [s for s in self.scheduler.running if s.finish_reason is None]
        rows = [s for s in live if not s.in_prefill]
        prefilling = [s for s in live if s.in_prefill and id(s) not in self._leader_of]
        started = False
        if prefilling:
            budget = self.cfg.prefill_chunk if rows else self.cfg.max_prefill_tokens
            events.extend(self._prefill_step(prefilling, budget))
            started = any(not s.in_prefill for s in prefilling)
        if rows and not started:  # new first tokens go out now; decoding resumes next step
            plan = self.plan(len(rows), len(prefilling), [s.accept for s in rows])
            events.extend(self._cycle(rows, plan))
        for seq in [s for s in self.scheduler.running if s.finish_reason is not None]:
            self._free(seq)
        return events

    def plan(self, batch: int, joining: int = 0, evidence=()) -> Plan:
        """This cycle's block size (1: target-only decoding) and whether to pre-draft. Without
        the adaptive controller the block shrinks as the batch grows, so that one verify pass
        stays within the token budget. The controller plans for the batch about to decode:
        `joining` requests are still prefilling and decode from the next cycles on, so a
        batch that is short for one cycle is not worth switching plans for. `evidence`: the
        decoding rows' own acceptance counts (Sequence.accept). The controller's verify budget
        is that batch's too: the plans it may choose at a bucket are those calibrated there.
        With the decoding rows' budget instead, a few rows decoding while the rest of a load
        of 16 prefilled were allowed a block of 8, never measured at 16 rows, so the
        controller warmed it up there again and again: each warm-up ran at the few rows'
        bucket, where it was recorded (measured: 6 such warm-ups in one MT-Bench load at
        concurrency 16, from the server's d3d:controller_plan_cycles_total)."""
        if self.drafting is None:
            return Plan(1)
        if self.controller is not None:
            budget = self.cfg.verify_token_budget // (batch + joining)
            return self.controller.choose(batch + joining, budget, evidence)
        budget = self.cfg.verify_token_budget // batch  # tokens per row in one verify pass
        block = min(self.cfg.fixed_block, budget)
        if block < self.cfg.min_block_size:
            return Plan(1)
        return Plan(block, self.cfg.mode is Mode.ASYNC)

    # ---- prefill ----------------------------------------------------------------------------
    def _share_prefills(self, admitted: list[Sequence]) -> None:
        """A newly admitted prompt identical to one admitted in the same step (another choice
        of an `n` > 1 request, or any request with the same prompt) follows it: it is not
        prefilled, but copies the leader's cache slot once the leader's prefill completes, and
        draws its own first token from the same logits."""
        leaders: dict[tuple[int, ...], Sequence] = {}
        for seq in admitted:
            lead = leaders.setdefault(tuple(seq.tokens), seq)
            if lead is not seq:
                self._leader_of[id(seq)] = lead
                self._followers.setdefault(id(lead), []).append(seq)

    def _prefill_step(self, seqs: list[Sequence], budget: int) -> list[TokenEvent]:
        """Prefill the next chunks of the prompts still prefilling (FIFO, `budget` tokens in
        all) in one packed pass. A failed pass is retried chunk by chunk, so a bad request
        fails alone (with the choices that follow it)."""
        work = list(zip(seqs, plan_chunks([s.num_prompt - s.prefilled for s in seqs], budget)))
        try:
            return self._prefill_pass(work)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            if len(work) > 1:
                return [ev for w in work for ev in self._prefill_step([w[0]], w[1])]
            lead, error = work[0][0], f"{type(e).__name__}: {e}"
            return [self._finish(s, "error", error=error) for s in [lead, *self._pop_followers(lead)]]

    def _prefill_pass(self, work: list[tuple[Sequence, int]]) -> list[TokenEvent]:
        """On every core: time to first token is the target's prefill alone. The drafter
        reads the prompt in its first (synchronous) draft, right after."""
        t0 = time.perf_counter()
        for s, _ in work:
            if s.prefilled == 0:
                self._start_prefill(s, t0)
        chunks = [(s.slot, s.prefilled, s.tokens[s.prefilled : s.prefilled + n]) for s, n in work]
        with intra_op_threads(self._alone_threads):
            logits = self.target.prefill_chunks(chunks)  # [len(work), V]
        events = []
        for i, (s, n) in enumerate(work):
            s.prefilled += n
            if not s.in_prefill:
                events.append(self._isolated(s, self._first_token, s, logits[i]))
                events += [self._isolated(f, self._fork_prefill, s, f, logits[i])
                           for f in self._pop_followers(s)]
        return events

    def _start_prefill(self, seq: Sequence, t0: float) -> None:
        seq.prefill_start = t0
        seq.stats.queue_time = max(0.0, time.monotonic() - seq.submit_time)

    def _pop_followers(self, lead: Sequence) -> list[Sequence]:
        followers = self._followers.pop(id(lead), [])
        for f in followers:
            self._leader_of.pop(id(f), None)
        return [f for f in followers if f.finish_reason is None]  # not those aborted meanwhile

    def _fork_prefill(self, lead: Sequence, seq: Sequence, logits: torch.Tensor) -> TokenEvent:
        self._start_prefill(seq, lead.prefill_start)
        self.target.fork(lead.slot, seq.slot)
        seq.prefilled = seq.num_prompt
        return self._first_token(seq, logits)

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> TokenEvent:
        ruled = _ruled_chain(logits.unsqueeze(0), seq, [])[0]  # [V]
        token = sample(target_probs(ruled, seq.params), seq.generator)
        seq.stats.prefill_time = time.perf_counter() - seq.prefill_start
        if self.drafting is not None:
            self.drafting.start(seq.slot, seq.tokens + [token], seq.params, seq.generator,
                                seq.constraint)
        return self._emit(seq, [token], logits.unsqueeze(0))

    # ---- one speculative cycle --------------------------------------------------------------
    def _cycle(self, rows: list[Sequence], plan: Plan) -> list[TokenEvent]:
        self._steps += 1
        alone = self._alone_threads
        copies = self._copies(rows, plan)
        way = self._copy_way(len(rows)) if copies and all(copies) else None
        copy_cycle = way is not None
        if copy_cycle:  # no drafter pass: the controller's plan waits for the next cycle
            outcomes = self._copy_cycle(rows, copies, way)
        elif isinstance(self.drafting, FusedDrafting):
            with intra_op_threads(alone):
                outcomes = self.drafting.cycle(rows, self._accept, plan, self._steps)
        else:
            verify = partial(self._verify, threads=self.cfg.target_threads if plan.overlap else alone)
            sampled = [c if not s.params.greedy else [] for s, c in zip(rows, copies)]
            proposing = self.proposals.for_cycle(len(rows), self.cfg.verify_token_budget, sampled)
            outcomes = run_cycle(rows, self.drafting, verify, self.executor, plan, self._steps,
                                 alone, proposing)
        self.timeline.add(outcomes[0].times)
        if not copy_cycle:  # a cycle of copies was booked by _copy_cycle
            self._observe(rows, plan, outcomes)
        return [self._settle(s, o) for s, o in zip(rows, outcomes, strict=True)]

    def _copy_way(self, batch: int) -> Way | None:
        """How a cycle whose rows all found copies runs (copy_arms.py), or None: the plan,
        where the controller expects more tokens a second per row of it than copies have
        measured."""
        expected = self.controller.expected if self.controller is not None else None
        return self.copy_arms.choose(batch, expected)

    def _copy_cycle(self, rows: list[Sequence], copies: list[list[int]],
                    way: Way) -> list[Outcome]:
        verify = partial(self._verify, threads=self._alone_threads)
        if way.short:
            keep = max(1, self._lookup(len(rows), beside=0) // 2)
            copies = [c[:keep] for c in copies]
        outcomes = run_copy_cycle(rows, self.drafting, verify, copies, self._steps,
                                  self._copy_trees(rows, copies, way.guesses))
        tokens, seconds = _tokens(outcomes), outcomes[0].times.end
        self.copy_arms.observe(len(rows), way, tokens, seconds)
        # nobody's plan, but its time is decoding time all the same
        self.plan_listeners.notify(len(rows), COPIES, seconds, tokens)
        return outcomes

    def _observe(self, rows: list[Sequence], plan: Plan, outcomes: list[Outcome]) -> None:
        """The controller and the plan listeners learn from a cycle of `plan`: its time, and
        the acceptance of the rows that drafted (not of copies, which are not the drafter's)."""
        seconds = outcomes[0].times.end
        if self.controller is not None:
            own = [(s, o) for s, o in zip(rows, outcomes, strict=True) if o.stats and not o.stats.copied]
            tested = self._tested(plan, [o for _, o in own])
            self.controller.observe(len(rows), plan, seconds, tested)
            self.controller.observe_trees(
                plan, [(o.stats.num_accepted, o.chain[1]) for _, o in own if o.chain])
            for (s, _), t in zip(own, tested, strict=True):
                s.accept.add(*t)
        self.plan_listeners.notify(len(rows), plan, seconds, _tokens(outcomes))

    def _copies(self, rows: list[Sequence], plan: Plan) -> list[list[int]]:
        """Per row, a run copied from its own text (or others') to verify without drafting
        (`copy_ngram`), as long as the verify token budget allows ([]: none; [] for all:
        copies are off). Where every row has one the cycle makes no drafter pass. Elsewhere a
        greedy row takes its copy in the drafter's tree (`lookup_tokens`), and a sampled row
        still verifies its copy alone, so a sampled row copies only where the plan verifies
        trees (trees on, no pre-drafting, whose cycles verify chains;
        `Drafting.row_copies`)."""
        p = self.proposals
        if not isinstance(self.drafting, Drafting) or not p.copy_ngram:
            return []
        return Drafting.row_copies([self.drafting.states[s.slot] for s in rows],
                                   self._lookup(len(rows), beside=0), p.copy_ngram,
                                   self._elsewhere(), plan.verifies_trees(p.tree_nodes))

    def _copy_trees(self, rows: list[Sequence], copies: list[list[int]],
                    guesses: bool) -> list[DraftTree] | None:
        """A cycle of copies' trees, of one size: a greedy row's copy with up to
        `copy_guesses` / batch of the other texts' guesses beside it (so a pass carries at most
        `copy_guesses` more tokens, whatever its batch), a sampled row's copy alone (a chain
        of sure nodes, as in a cycle of trees); None (chains) where every row is greedy and
        no row has room for a guess."""
        extra = self.cfg.copy_guesses // len(rows) if guesses else 0  # the pass's, shared out
        sampled = any(not s.params.greedy for s in rows)
        if not extra and not sampled:
            return None
        length, elsewhere = self._lookup(len(rows), beside=0), self._elsewhere()
        room = self.cfg.verify_token_budget // len(rows) - 1
        trees = [sure_chain(c) if not s.params.greedy else
                 sure_trie(Drafting.copy_guesses(self.drafting.states[s.slot], c, length,
                                                 elsewhere, extra),
                           min(room, len(c) + extra))  # a copy fits in `room` already
                 for s, c in zip(rows, copies, strict=True)]
        return [pad(t, max(t.size for t in trees)) for t in trees]

    def _elsewhere(self) -> list:
        """Texts other than a row's own that greedy rows copy from, in the order asked."""
        return [x for x in (self.shared_text, self.corpus) if x is not None]

    def _corpus(self, drafter: D3DDrafter | None) -> CorpusIndex | None:
        """The index of the drafter's corpus within `corpus_tokens`, where rows copy at all."""
        if not self._separate_drafter or not self.proposals.copy_ngram:
            return None
        return corpus_index(drafter, self.cfg.corpus_tokens)

    def _lookup(self, batch: int, beside: int | None = None) -> int:
        return self.proposals.lookup(batch, self.cfg.verify_token_budget, beside)

    def _tested(self, plan: Plan, outcomes: list[Outcome]) -> list[tuple[int, int]]:
        """(drafts put to the test, accepted) per row, for the controller's acceptance rates.
        A fused cycle that missed its branches verifies no drafts the next time, and a cut
        block (`draft_cutoff`) leaves its unsure drafts out; counting the block's missing
        drafts as rejected folds that into the rates, so the controller's expected tokens per
        cycle of the plan stay right. A token tree counts as its top-1 chain would have
        (`Outcome.chain`): the rates are the chain's, whichever way blocks were verified."""
        short = plan.block > 1 and (isinstance(self.drafting, FusedDrafting)
                                    or self.proposals.draft_cutoff > 0)
        out = []
        for o in outcomes:
            if o.stats is None:
                continue
            tested, n = o.chain or (o.stats.num_drafts, o.stats.num_accepted)
            out.append((max(tested, plan.block - 1) if short else tested, n))
        return out

    def _verify(self, rows: list[Sequence], tokens: torch.Tensor, proposals: list,
                trees: list[DraftTree] | None = None, *, threads: int) -> list[Verdict]:
        """tokens [N, B]: the target scores every row's block (a chain, or a token tree) in
        one pass."""
        shape = None if trees is None else tree_inputs(trees)
        with intra_op_threads(threads):
            logits = self.target.forward_block([s.slot for s in rows], tokens, shape)  # [N, B, V]
        if trees is not None:
            return self._accept_trees(rows, trees, proposals, logits)
        return self._accept(rows, tokens[:, 1:].tolist(), proposals, list(logits))

    def _accept_trees(self, rows: list[Sequence], trees: list[DraftTree], proposals: list,
                      logits: torch.Tensor) -> list[Verdict]:
        """logits [N, M+1, V]: each row walks down its tree (greedy: the target's argmax;
        sampled: recursive rejection sampling, tree_sampling.py); the target keeps the accepted
        path where a chain would have written it."""
        verdicts = []
        for s, tree, q, lg in zip(rows, trees, proposals, logits, strict=True):
            try:
                path, token = self._walk(s, tree, q, _ruled_tree(lg, s, tree))
                self.target.keep_path(s.slot, path)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                verdicts.append(Verdict(error=f"{type(e).__name__}: {e}"))
                continue
            self.target.advance(s.slot, len(path) + 1)
            verdicts.append(Verdict(len(path), token, lg[[0, *path]],
                                    path=tuple(path_tokens(tree, path))))
        return verdicts

    @staticmethod
    def _walk(s: Sequence, tree: DraftTree, q: torch.Tensor,
              logits: torch.Tensor) -> tuple[list[int], int]:  # logits [M+1, V], reshaped
        if s.params.greedy:
            return greedy_tree_accept(tree, logits.argmax(-1).tolist())
        return sampled_tree_accept(tree, q, target_probs(logits, s.params), s.generator)

    def _accept(self, rows: list[Sequence], drafts: list[list[int]], proposals: list,
                logits: list[torch.Tensor]) -> list[Verdict]:
        """logits [G+1, V] per row: each row is accepted on its own, so one request's failure
        fails it alone; the target keeps the accepted drafts and the last verified token."""
        verdicts = []
        for i, s in enumerate(rows):
            try:
                ruled = _ruled_chain(logits[i], s, drafts[i])  # [G+1, V]
                n, token = verify_draft(drafts[i], proposals[i], ruled, s.params, s.generator)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                verdicts.append(Verdict(error=f"{type(e).__name__}: {e}"))
                continue
            self.target.advance(s.slot, n + 1)  # the accepted drafts and the last verified token
            verdicts.append(Verdict(n, token, logits[i][: n + 1]))
        return verdicts

    def _settle(self, s: Sequence, o: Outcome) -> TokenEvent:
        """One request's books for the cycle: stats and listeners, then its tokens out."""
        record(s.request_id, s.stats, o, self.cycle_listeners)
        if o.error is not None:
            return self._finish(s, "error", error=o.error)
        return self._isolated(s, self._emit, s, o.tokens, o.logits)

    def _isolated(self, s: Sequence, fn, *args) -> TokenEvent:
        """Run one request's part of a step; its failure fails that request alone."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            return self._finish(s, "error", error=f"{type(e).__name__}: {e}")

    # ---- output -----------------------------------------------------------------------------
    def _emit(self, s: Sequence, new: list[int], logits: torch.Tensor) -> TokenEvent:
        """Append accepted tokens, cut at a stop token or the length limit. logits [>=T, V]:
        row j is the target's verify row that scored new[j] (for log-probabilities)."""
        out, reason = [], None
        for t in new[: s.remaining]:
            out.append(t)
            if t in s.stop_ids:
                reason = "stop"
                break
        if reason is None and s.num_generated + len(out) >= s.params.max_new_tokens:
            reason = "length"
        if s.constraint is not None:
            s.constraint.advance(out)
        s.tokens.extend(out)
        s.stats.generated_tokens = s.num_generated
        k = s.req.logprobs
        lp = None if k is None else token_logprobs(logits[: len(out)], out, k)
        if reason is not None:
            return self._finish(s, reason, out, logprobs=lp)
        return TokenEvent(s.request_id, out, logprobs=lp)

    def _finish(self, s: Sequence, reason: str, out=None, error=None, logprobs=None) -> TokenEvent:
        s.finish_reason = reason
        if self.shared_text is not None and reason in ("stop", "length"):
            self.shared_text.add(s.tokens)  # prompt and answer (_emit appended it)
        if s.slot >= 0 and reason == "abort":  # aborted sequences leave the schedule at once
            self._free_slot(s.slot)
        return TokenEvent(s.request_id, out or [], True, reason, error, s.stats, logprobs)

    def fail_running(self, message: str) -> list[TokenEvent]:
        """A batched pass failed for everyone in it: end those requests, keep serving."""
        events = []
        for seq in list(self.scheduler.running):
            events.append(self._finish(seq, "error", error=message))
            self._free(seq)
        return events

    def _free(self, seq: Sequence) -> None:
        self.scheduler.release(seq)
        self._free_slot(seq.slot)

    def _free_slot(self, slot: int) -> None:
        self.target.free(slot)
        if self.drafting is not None:
            self.drafting.release(slot)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def shutdown(self) -> None:
        self.executor.shutdown()


def _ruled_chain(logits: torch.Tensor, s: Sequence, drafts: list[int]) -> torch.Tensor:
    """[G+1, V]: a chain's verify logits under the request's logit rules and grammar."""
    ruled = reshape_chain(logits, s, drafts, s.params)
    return ruled if s.constraint is None else constrain(ruled, s.constraint.chain(drafts))


def _ruled_tree(logits: torch.Tensor, s: Sequence, tree: DraftTree) -> torch.Tensor:
    """[M+1, V]: a token tree's verify logits under the request's logit rules and grammar."""
    ruled = reshape_tree(logits, s, tree, s.params)
    return ruled if s.constraint is None else constrain(ruled, s.constraint.tree(tree))


def _tokens(outcomes: list[Outcome]) -> int:
    """Tokens a cycle produced over all its rows (before any stop trims them)."""
    return sum(len(o.tokens) for o in outcomes)
