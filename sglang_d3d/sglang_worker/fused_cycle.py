"""One forward per cycle: SGLang's verify rows and the next block's mask rows together.

The embedded engine's fused mode (speculative/fused.py) inside SGLang, for a full-depth drafter
that shares the target (pool_draft.py):

    forward  SGLang's target, TARGET_VERIFY, over each request's verify block [c, d1 .. d_{B-1}]
             and K branches of mask rows anchored at verify tokens (fused_layout.py); the
             drafter's mask embedding and deltas apply at the mask rows only (delta_hooks.py),
             the mask rows see the verify rows and never the other way round
             (torch_native_verify.py), so the verify rows are SGLang's verify rows
    accept   speculative/verify.py over the verify rows, as in the two-pass cycle
    carry    the branch anchored at the accepted count n predicted the tokens after the target's
             token: they are the next cycle's drafts (a hit). With a branch at every verify
             index (K >= B, the default at block 4) every outcome hits and the cycle copies
             nothing to the host; with fewer, one copy a cycle brings back which rows hit and the
             drafter's probabilities of its drafts (to choose the next anchors). On a miss, or
             for a request the last cycle did not carry (new, or after a plain cycle), the
             cycle verifies the target's token with placeholder drafts and a branch anchored
             at it, which always hits.

The weights are read once per cycle instead of twice (a draft pass, then a verify pass); the
price is that the first draft is a two-ahead prediction (the drafter anchors at the last
verify token, not at the target's next one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_d3d.sglang_worker import delta_hooks
from sglang_d3d.sglang_worker.fused_layout import BatchLayout, anchors_for, batch_layout
from sglang_d3d.sglang_worker.shared_cycle import SharedCycle, Written, accepted_run
from sglang_d3d.sglang_worker.torch_native_verify import FUSED
from sglang_d3d.sglang_worker.verify_io import block_cache_loc, build_verify_forward_batch
from sglang_d3d.speculative.penalties import reshape_rows
from sglang_d3d.speculative.verify import verify_batch


@dataclass(frozen=True)
class Carried:
    """What one fused cycle leaves the next: each carried request's drafts and anchors."""

    rows: dict[str, int]  # request id -> its row of `drafts`
    drafts: torch.Tensor  # [N_prev, B-1] on the device
    anchors: dict[str, tuple[int, ...]]  # request id -> the next cycle's anchors (hits only)


class FusedCycle:
    def __init__(self, shared: SharedCycle, layers, sglang_model, branches: int) -> None:
        """shared: the two-pass cycle (its request books, counters and drafter);
        layers: shared_layers.fused_layers (the deltas, stacked); branches: K per request."""
        self.shared = shared
        self.drafter = shared.pool.drafter
        self.block = shared.pool.block
        self.masks = shared.pool.pack - 1  # a branch is drafted at a trained block at least
        self.branches = max(1, branches)
        self.hooks = delta_hooks.install(layers, sglang_model)
        self.carried: Carried | None = None

    def forget(self) -> None:
        """Another kind of cycle (or a prefill) ran: the carried drafts no longer follow."""
        self.carried = None

    def run(self, batch, device: torch.device):
        """-> (SGLang's verify output, run [N, block] on device, accept_lens [N] int32)."""
        reqs, w, counters = batch.reqs, self.block, self.shared.counters
        t0 = time.perf_counter()
        drafts, anchors = self._carried(reqs, device)  # [N, B-1], per request
        layout = batch_layout(anchors, w, self.masks, device)
        fb, rows = self._forward_batch(batch, drafts, layout, device)
        t1 = time.perf_counter()
        n, t = len(reqs), layout.tokens
        span = (w, t) if n == 1 else None
        with delta_hooks.mask_rows(self.drafter.gate, rows, n * t,
                                   self.drafter.mask_embedding.dtype, span):
            out = self.shared.target_worker.forward_batch_generation(
                batch=None, forward_batch=fb, is_verify=True)
        counters.target_s += time.perf_counter() - t1
        logits = out.logits_output.next_token_logits[:, : self.shared.vocab_size]
        logits = logits.view(n, t, -1)  # [N, T, V]
        verify = logits[:, :w]  # [N, B, V]
        out.logits_output.next_token_logits = verify.reshape(n * w, -1)  # the verify rows'
        books = self.shared._books(reqs)
        params = [b.params for b in books]
        if any(p.reshapes_logits for p in params):
            counters.host_copies += 1  # reshape_rows reads the drafts once
            verify = reshape_rows(verify, drafts, [Written(r) for r in reqs], params)
        accepted, token = verify_batch(drafts, verify, params, [None] * n,
                                       [b.random for b in books])
        run = accepted_run(drafts, accepted, token, self.block, w)
        self._carry(reqs, logits[:, w:], layout, accepted)
        counters.fused_steps += 1
        counters.draft_s += t1 - t0
        counters.verify_s += time.perf_counter() - t1
        return out, run, (accepted + 1).to(torch.int32)

    def _carried(self, reqs, device) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """Each request's drafts and anchors from the last cycle, or placeholders."""
        w, k, c = self.block, self.branches, self.carried
        fresh_anchors = anchors_for(None, w, k)
        if c is None:
            return (torch.zeros(len(reqs), w - 1, dtype=torch.int64, device=device),
                    [fresh_anchors] * len(reqs))
        anchors = [c.anchors.get(r.rid, fresh_anchors) for r in reqs]
        index = [c.rows.get(r.rid, -1) for r in reqs]
        if index == list(range(c.drafts.shape[0])) and len(c.anchors) == len(reqs):
            return c.drafts, anchors  # the same requests, all carried: no gather
        idx = torch.tensor(index, dtype=torch.int64).to(device)
        kept = torch.tensor([r.rid in c.anchors for r in reqs]).to(device)
        drafts = torch.where(kept[:, None], c.drafts[idx.clamp(min=0)], 0)
        return drafts, anchors

    def _forward_batch(self, batch, drafts: torch.Tensor, layout: BatchLayout, device):
        """SGLang's TARGET_VERIFY ForwardBatch over the fused rows. -> (fb, mask rows [N*K*M])."""
        n, t, w = len(batch.reqs), layout.tokens, layout.width
        last = torch.tensor([r.output_ids[-1] for r in batch.reqs], dtype=torch.int64)
        ids = torch.zeros(n, t, dtype=torch.int64, device=device)
        ids[:, 0] = last.to(device)
        ids[:, 1:w] = drafts
        positions = batch.seq_lens.to(torch.int64)[:, None] + layout.rel_pos  # [N, T]
        loc = torch.zeros(n, t, dtype=torch.int64, device=device)  # masks: SGLang's padding slot
        runner = self.shared.target_worker.model_runner
        loc[:, :w] = block_cache_loc(runner.req_to_token_pool.req_to_token,
                                     batch.req_pool_indices, batch.seq_lens, w).view(n, w)
        fb, _ = build_verify_forward_batch(batch, self.shared.target_worker, ids, t,
                                           positions.reshape(-1), loc.reshape(-1))
        setattr(fb.spec_info, FUSED, layout)  # read where SGLang plans the attention
        rows = layout.mask_rows()
        emb = self.drafter.mask_embedding
        fb.replace_embeds = emb[None, :].expand(rows.numel(), -1)
        fb.replace_positions = rows
        return fb, rows

    def _carry(self, reqs, branch_logits: torch.Tensor, layout: BatchLayout,
               accepted: torch.Tensor) -> None:
        """branch_logits [N, K*M, V]: keep the hit branch's drafts for the next cycle."""
        n, k, w = len(reqs), layout.anchors.shape[1], self.block
        per = branch_logits.view(n, k, self.masks, -1)[:, :, : w - 1]  # [N, K, B-1, V]
        match = layout.anchors == accepted[:, None].to(torch.int64)  # [N, K]
        pick = match.to(torch.int8).argmax(1)  # the first branch at the outcome
        chosen = per[torch.arange(n, device=per.device), pick]  # [N, B-1, V]
        drafts = chosen.argmax(-1)  # [N, B-1]
        rows = {r.rid: i for i, r in enumerate(reqs)}
        if k >= w:  # a branch at every outcome: every request hits
            full = anchors_for(None, w, k)
            self.carried = Carried(rows, drafts, {r.rid: full for r in reqs})
            return
        keep = torch.softmax(chosen.float(), -1).gather(2, drafts[..., None]).squeeze(2)
        host = torch.cat([match.any(1, keepdim=True).float(), keep], 1).tolist()
        self.shared.counters.host_copies += 1  # the cycle's one copy: hits and probabilities
        anchors = {r.rid: anchors_for(h[1:], w, k) for r, h in zip(reqs, host) if h[0]}
        self.carried = Carried(rows, drafts, anchors)
