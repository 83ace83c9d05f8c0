"""Our per-request record of SGLang's requests: a drafter cache slot with its `DraftState`, and
the request's speculation stats.

SGLang owns the requests; the drafter needs a cache slot and the tokens it has seen for each.
The table keys them by request id and keeps them in step with SGLang's own record of the request
(`origin_input_ids + output_ids`), so prefill chunks, retraction and re-prefill never leave the
drafter with a wrong history: whatever it has not seen goes to `pending`, and a history that no
longer matches is rebuilt from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_d3d.sglang_worker.accept import Role, request_generator, to_sampling_params
from sglang_d3d.speculative.draft_state import DraftState
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.sampling import RequestRandom
from sglang_d3d.speculative.stats import RequestStats


@dataclass
class RequestRow:
    """One SGLang request as the worker tracks it; a `Row` of the speculative cycle."""

    rid: str
    state: DraftState  # drafting's (speculative/draft_state.py); read, never written, here
    stats: RequestStats
    verify_random: RequestRandom  # verification's draws; drafting has its own (accept.Role)

    @property
    def slot(self) -> int:
        return self.state.slot

    @property
    def last_token(self) -> int:
        return self.state.last_token

    @property
    def tokens(self) -> list[int]:
        """Prompt and output as drafting knows them (kept in step by `sync`)."""
        return self.state.tokens

    @property
    def num_prompt(self) -> int:
        return self.stats.prompt_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        """None needed: SGLang applies its own min_new_tokens, a request the worker refuses."""
        return frozenset()


class RequestTable:
    def __init__(self, drafting: Drafting, num_slots: int, vocab_size: int) -> None:
        self.drafting = drafting
        self.vocab_size = vocab_size
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots))
        self.rows: dict[str, RequestRow] = {}
        self._last_seen: dict[str, int] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self.rows)

    def rows_for(self, reqs) -> list[RequestRow]:
        """The batch's rows in batch order, each created on first sight. The whole batch is
        marked seen before any row is created: making room for a new request then evicts only
        requests that left, never a live one later in the same batch."""
        self._step += 1
        for req in reqs:
            self._last_seen[req.rid] = self._step
        return [self._row(req) for req in reqs]

    def _row(self, req) -> RequestRow:
        row = self.rows.get(req.rid)
        return row if row is not None else self._create(req)

    def sync(self, row: RequestRow, req) -> None:
        """Bring the drafter's view of the request up to SGLang's record of it: the tokens
        past those it knows. A request's prompt and outputs only grow, so this reads the new
        tokens and checks the two records agree at their ends, not the whole history every
        cycle; where they disagree (rewritten history, which should not happen), the drafter
        cache is rebuilt from SGLang's record."""
        prompt, out = req.origin_input_ids, req.output_ids
        known = row.state.tokens
        if len(known) <= len(prompt) + len(out) and (
                not known or (_at(prompt, out, 0) == known[0]
                              and _at(prompt, out, len(known) - 1) == known[-1])):
            new = _after(prompt, out, len(known))
            if new:
                self.drafting.skip(row.state, new)
            return
        self.drafting.restart(row.state, list(prompt) + list(out))

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        self._last_seen.pop(rid, None)
        if row is not None:
            self.drafting.release(row.slot)
            self.free_slots.append(row.slot)

    def _create(self, req) -> RequestRow:
        if not self.free_slots:
            self._evict_stale()
        params = to_sampling_params(req.sampling_params, self.vocab_size)
        # The drafter has seen nothing yet. The first sync makes the whole prompt (and SGLang's
        # first sampled token) pending; the first synchronous draft reads it, as in the
        # embedded engine.
        state = self.drafting.start(self.free_slots.pop(), [], params,
                                    request_generator(req.rid, params.seed, Role.DRAFTING))
        row = RequestRow(req.rid, state, RequestStats(prompt_tokens=len(req.origin_input_ids)),
                         request_generator(req.rid, params.seed, Role.VERIFICATION))
        self.rows[req.rid] = row
        return row

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


def _at(prompt, out, i: int) -> int:
    """Token i of the request's record: its prompt, then its outputs."""
    return prompt[i] if i < len(prompt) else out[i - len(prompt)]


def _after(prompt, out, n: int) -> list[int]:
    """The request's record past its first n tokens."""
    if n >= len(prompt):
        return list(out[n - len(prompt) :])
    return list(prompt[n:]) + list(out)
