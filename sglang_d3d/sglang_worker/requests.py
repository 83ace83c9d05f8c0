"""Our per-request drafting state (the embedded engine's `Sequence`) for SGLang's requests.

SGLang owns the requests; the drafter needs a cache slot and the tokens it has seen for each.
The table keys them by request id and keeps them in step with SGLang's own record of the request
(`origin_input_ids + output_ids`), so prefill chunks, retraction and re-prefill never leave the
drafter with a wrong history: whatever it has not seen goes to `pending`, and a history that no
longer matches is rebuilt from scratch.
"""

from __future__ import annotations

from sglang_d3d.engine.api import GenerationRequest
from sglang_d3d.engine.drafting import Drafting
from sglang_d3d.engine.sequence import Sequence
from sglang_d3d.sglang_worker.accept import request_generator, to_sampling_params


class RequestTable:
    def __init__(self, drafting: Drafting, num_slots: int, vocab_size: int) -> None:
        self.drafting = drafting
        self.vocab_size = vocab_size
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots))
        self.rows: dict[str, Sequence] = {}
        self._last_seen: dict[str, int] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self.rows)

    def rows_for(self, reqs) -> list[Sequence]:
        """The batch's rows in batch order, each created on first sight. The whole batch is
        marked seen before any row is created: making room for a new request then evicts only
        requests that left, never a live one later in the same batch (issue 10)."""
        self._step += 1
        for req in reqs:
            self._last_seen[req.rid] = self._step
        return [self._row(req) for req in reqs]

    def _row(self, req) -> Sequence:
        seq = self.rows.get(req.rid)
        return seq if seq is not None else self._create(req)

    def sync(self, seq: Sequence, req) -> None:
        """Bring seq.tokens up to SGLang's record of the request."""
        full = list(req.origin_input_ids) + list(req.output_ids)
        known = seq.tokens
        if full == known:
            return
        if full[: len(known)] == known:
            self.drafting.skip(seq, full[len(known) :])
        else:  # rewritten history (should not happen): rebuild the drafter cache
            self.drafting.runner.reset(seq.slot)
            seq.pending = list(full)
            seq.draft, seq.draft_q, seq.branches, seq.branch_logits = None, None, [], None
        seq.tokens = full

    def release(self, rid: str) -> None:
        seq = self.rows.pop(rid, None)
        self._last_seen.pop(rid, None)
        if seq is not None:
            self.drafting.runner.reset(seq.slot)
            self.free_slots.append(seq.slot)

    def _create(self, req) -> Sequence:
        if not self.free_slots:
            self._evict_stale()
        params = to_sampling_params(req.sampling_params, self.vocab_size)
        greq = GenerationRequest(req.rid, list(req.origin_input_ids), params)
        # tokens = what the drafter has seen: nothing yet. The first sync makes the whole
        # prompt (and SGLang's first sampled token) pending; the first synchronous draft reads
        # it, as in the embedded engine.
        seq = Sequence(req=greq, tokens=[])
        seq.num_prompt = len(req.origin_input_ids)
        seq.slot = self.free_slots.pop()
        self.drafting.runner.reset(seq.slot)  # the slot may hold a finished request's cache
        seq.generator = request_generator(req.rid, params.seed)
        seq.stats.prompt_tokens = seq.num_prompt
        self.rows[req.rid] = seq
        return seq

    def _evict_stale(self) -> None:
        """Free the slots of requests that left without a finish notice (aborted in the queue,
        finished at prefill): everything not seen in the current step."""
        for rid, seen in list(self._last_seen.items()):
            if seen < self._step:
                self.release(rid)
        if not self.free_slots:
            raise RuntimeError(
                f"D3D drafter cache is full: more running requests than its {self.num_slots} "
                "slots (--max-running-requests sizes it)"
            )
