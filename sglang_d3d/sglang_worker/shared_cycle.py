"""The D3D cycle of a full-depth drafter that shares SGLang's target (pool_draft.py):

    draft    one drafter pass per batch: [x_last, masks] per request over SGLang's KV pool
    verify   SGLang's target, TARGET_VERIFY, one pass, attention metadata planned once
    accept   speculative/verify.py on the target's device (greedy, or rejection sampling
             against the drafts as a point mass: exact in distribution)
    commit   the accepted run and the new lengths stay on the device for SGLang's scheduler

Nothing per cycle reads a request's history: the block starts from `output_ids[-1]`, the
lengths are SGLang's, and the drafter has no state to keep in step (no prefill, no cache). The
worker itself copies nothing to the host (SGLang's scheduler reads the results as it does for
its own speculative workers); the one exception is a request with penalties or a logit bias,
whose rules need the drafts on the host (speculative/penalties.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.sglang_worker.accept import Role, request_generator, to_sampling_params
from sglang_d3d.sglang_worker.counters import Counters
from sglang_d3d.sglang_worker.pool_draft import PoolDrafter
from sglang_d3d.sglang_worker.verify_io import build_verify_forward_batch
from sglang_d3d.speculative.penalties import reshape_rows
from sglang_d3d.speculative.sampling import RequestRandom
from sglang_d3d.speculative.verify import verify_batch


@dataclass(frozen=True)
class Written:
    """A request's tokens for the logit rules (penalties.Written), read only where a rule needs
    them: prompt + output, the verify block's root included."""

    req: object

    @property
    def tokens(self) -> list[int]:
        return list(self.req.origin_input_ids) + list(self.req.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.req.origin_input_ids)

    stop_ids = frozenset()  # SGLang applies min_new_tokens itself: a request D3D refuses


@dataclass
class RequestBooks:
    """What the cycle keeps per request: its sampling parameters and verification's random
    stream, made once on first sight (O(1) per request per cycle afterwards)."""

    params: SamplingParams
    random: RequestRandom


def accepted_run(drafts: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor,
                 block: int, width: int | None = None) -> torch.Tensor:
    """drafts [N, width-1], accepted [N], token [N] -> [N, block]: row i is d1 .. d_a, the
    target's token, then zeros (SGLang reads accepted + 1 tokens of each row, rows `block`
    apart whatever width was verified)."""
    n, g = drafts.shape[0], (block if width is None else width) - 1
    cols = torch.arange(g, device=drafts.device)
    out = torch.zeros(n, block, dtype=torch.int64, device=drafts.device)
    out[:, :g] = torch.where(cols[None, :] < accepted[:, None], drafts, 0)
    out.scatter_(1, accepted[:, None].to(torch.int64), token[:, None].to(torch.int64))
    return out


class SharedCycle:
    def __init__(self, pool: PoolDrafter, target_worker, vocab_size: int, counters: Counters):
        self.pool = pool
        self.target_worker = target_worker
        self.vocab_size = vocab_size
        self.counters = counters
        self.books: dict[str, RequestBooks] = {}

    def release(self, rid: str) -> None:
        self.books.pop(rid, None)

    def _books(self, reqs) -> list[RequestBooks]:
        if len(self.books) > 4 * len(reqs) + 64:  # requests that left without a finish notice
            live = {r.rid for r in reqs}
            self.books = {k: v for k, v in self.books.items() if k in live}
        out = []
        for r in reqs:
            b = self.books.get(r.rid)
            if b is None:
                params = to_sampling_params(r.sampling_params, self.vocab_size)
                b = RequestBooks(params, request_generator(r.rid, params.seed, Role.VERIFICATION))
                self.books[r.rid] = b
            out.append(b)
        return out

    def run(self, batch, device: torch.device, plain: bool = False):
        """-> (SGLang's verify output, run [N, block] on device, accept_lens [N] int32).
        `plain`: no drafts, a verify of the last token alone (one token per request; only
        where the attention backend verifies any width, see `torch_native_verify`)."""
        reqs, block = batch.reqs, self.pool.block
        last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=device)
        lens = batch.seq_lens
        t0 = time.perf_counter()
        if plain:
            drafts = last.new_zeros(len(reqs), 0)
        else:
            longest = (int(batch.seq_lens_cpu.max()) if batch.seq_lens_cpu is not None
                       else self._host(lens.max()))
            passes = self.pool.passes
            drafts = self.pool.draft(last, batch.req_pool_indices, lens, longest)  # [N, B-1]
            self.counters.drafter_passes += self.pool.passes - passes
        t1 = time.perf_counter()
        tokens = torch.cat([last[:, None], drafts], 1)  # [N, width]
        width = tokens.shape[1]
        fb, _ = build_verify_forward_batch(batch, self.target_worker, tokens, width)
        t2 = time.perf_counter()
        out = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb,
                                                          is_verify=True)
        self.counters.target_s += time.perf_counter() - t2
        logits = out.logits_output.next_token_logits[:, : self.vocab_size]
        logits = logits.view(len(reqs), width, -1)  # [N, width, V]
        books = self._books(reqs)
        params = [b.params for b in books]
        if any(p.reshapes_logits for p in params):
            self.counters.host_copies += 1  # reshape_rows reads the drafts once
            logits = reshape_rows(logits, drafts, [Written(r) for r in reqs], params)
        accepted, token = verify_batch(drafts, logits, params, [None] * len(reqs),
                                       [b.random for b in books])
        run = accepted_run(drafts, accepted, token, block, width)
        self.counters.draft_s += t1 - t0
        self.counters.verify_s += time.perf_counter() - t1
        return out, run, (accepted + 1).to(torch.int32)

    def _host(self, t: torch.Tensor) -> int:
        self.counters.host_copies += 1
        return int(t)
