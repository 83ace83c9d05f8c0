"""D3DWorker: SGLang's speculative worker for --speculative-algorithm D3D.

One `forward_batch_generation` call is one D3D cycle for every running request:

    sync     bring each request's drafter state up to SGLang's record of it
    draft    synchronous drafts where no pre-drafted branch hit (drafter thread)
    verify   SGLang's target worker, TARGET_VERIFY mode, its KV pool and radix cache   } at the
    predraft the drafter pre-drafts the next block for likely outcomes (async mode)  } same time
    accept   speculative/verify.py over the whole batch on the target's device (greedy, or
             rejection sampling); only accepted counts and next tokens reach the host
    follow   the drafter commits the hit branch or falls back (engine/drafting.py)

Prefill batches go to the target worker unchanged; the drafter reads a new prompt in its first
draft, as the embedded engine does.
The drafter (sglang_d3d.models.drafter) keeps its own KV cache and never reads the target's
hidden states; drafting and branch policy are the embedded engine's own code.
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_d3d.config import Mode
from sglang_d3d.engine.drafting import Drafting, draft_cache_len
from sglang_d3d.engine.timeline import CycleTimes, Timeline
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.sglang_worker.accept import unsupported_reason
from sglang_d3d.sglang_worker.draft_executor import DraftExecutor
from sglang_d3d.sglang_worker.draft_input import D3DDraftInput
from sglang_d3d.sglang_worker.drafter_loading import build_drafter, shared_target_weights
from sglang_d3d.sglang_worker.options import PluginOptions
from sglang_d3d.sglang_worker.requests import RequestTable
from sglang_d3d.sglang_worker.validation import DEFAULT_MAX_RUNNING_REQUESTS, check_vocab
from sglang_d3d.sglang_worker.verify_io import build_verify_forward_batch, commit_rows
from sglang_d3d.speculative.stats import CycleStats
from sglang_d3d.speculative.verify import verify_batch

log = logging.getLogger(__name__)


class D3DWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **_) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # no SGLang-managed draft model: ours has its own cache
        self.options = PluginOptions.from_env()
        runner = target_worker.model_runner
        # Resolved values live in SGLang's runtime context; server_args holds the raw input.
        self.block = int(get_spec().speculative_num_draft_tokens)
        self.vocab_size = int(runner.model_config.vocab_size)
        check_vocab(get_spec().speculative_draft_model_path, self.vocab_size, get_model().model_path)
        self.device = torch.device(runner.device)
        self.draft_device = _draft_device(self.options, self.device, gpu_id)
        self.drafting = Drafting(self._draft_runner(runner), self.options.spec_config(self.block))
        num_slots = len(self.drafting.runner.lengths)
        self.table = RequestTable(self.drafting, num_slots, self.vocab_size)
        self.executor = DraftExecutor(self.draft_device)
        self.timeline = Timeline(maxlen=10_000)
        self._steps = 0  # cycles run; the timeline keeps only the last 10,000
        self.cycle_listeners: list = []  # fn(request_id, CycleStats), like SpecEngine's
        cache = self.drafting.runner.cache
        log.info(
            "D3D worker: block %d, mode %s, drafter on %s, %d slots (cache %.2f GB)",
            self.block,
            self.options.mode.value,
            self.draft_device,
            num_slots,
            2 * cache.k.numel() * cache.k.element_size() / 1e9,  # K and V
        )

    def _draft_runner(self, runner) -> DraftRunner:
        dtype = _dtype(self.options.draft_dtype) or runner.dtype
        embed = head = None
        if self.draft_device == self.device:
            tp_size = get_parallel().tp_size
            embed, head = shared_target_weights(runner.model, self.vocab_size, tp_size)
        drafter = build_drafter(
            get_spec().speculative_draft_model_path,
            get_model().model_path,
            self.draft_device,
            dtype,
            embed,
            head,
        )
        spec = self.options.spec_config(self.block)
        size = draft_cache_len(runner.model_config.context_len, self.block,
                               drafter.cfg.smallest_block,
                               spec.num_outcomes * spec.guesses_per_position)
        # Allocated now, before SGLang sizes its KV pool from the memory left: the limit is the
        # one resolve_server_args declared (or the user's), never SGLang's pool-sized default.
        slots = int(get_schedule().max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS)
        return DraftRunner(drafter, slots, size)

    # ---- SGLang's entry point ------------------------------------------------------------
    def forward_batch_generation(
        self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            result = self._prefill(batch)
        elif batch.forward_mode.is_idle():
            result = self._idle()
        else:
            result = self._cycle(batch)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        seq = self.table.rows.get(rid)
        if seq is not None and seq.stats.num_cycles:
            st = seq.stats
            # The numbers SGLang's metrics cannot carry (branch hits, overlap) end up here.
            log.info(
                "D3D %s: %d cycles, mean accepted length %.2f, branch hit rate %s, overlap %.0f%%",
                rid, st.num_cycles, st.mean_accepted_length, st.branch_hit_rate,
                100 * st.overlap_fraction,
            )  # fmt: skip
        self.table.release(rid)

    # ---- prefill -------------------------------------------------------------------------
    def _prefill(self, batch) -> GenerationBatchResult:
        """The target prefills; the drafter reads each prompt in its first synchronous draft
        (as in the embedded engine), so time to first token is the target's prefill alone."""
        for req in batch.reqs:
            reason = unsupported_reason(req)
            if reason is not None:
                _abort(req, reason)
        result = self.target_worker.forward_batch_generation(batch)
        result.next_draft_input = D3DDraftInput()
        result.new_seq_lens = batch.seq_lens
        return result

    def _idle(self) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=empty,
            accept_lens=empty.to(torch.int32),
            next_draft_input=D3DDraftInput(),
            speculative_num_draft_tokens=self.block,
            new_seq_lens=empty,
        )

    # ---- one D3D cycle -------------------------------------------------------------------
    def _cycle(self, batch) -> GenerationBatchResult:
        rows = self.table.rows_for(batch.reqs)
        for seq, req in zip(rows, batch.reqs, strict=True):
            self.table.sync(seq, req)
        ct = CycleTimes(step=self._steps, batch=len(rows), block=self.block)
        self._steps += 1
        t0 = time.perf_counter()
        self.executor.submit(self.drafting.ensure_drafts, rows, self.block).result()
        ct.draft_end = time.perf_counter() - t0
        tokens = torch.tensor([[s.last_token] + s.draft for s in rows], dtype=torch.int64)
        predraft = None
        if self.options.mode is Mode.ASYNC:
            predraft = self.executor.submit(self.drafting.predraft, rows, self.block)
        target_out, can_graph, outcomes = self._verify(batch, rows, tokens, ct, t0)
        if predraft is not None:
            _, p0, p1 = predraft.result()
            ct.predraft_start, ct.predraft_end = p0 - t0, p1 - t0
        runs = self._accept(rows, outcomes, ct)
        out_tokens, accept_lens, new_seq_lens = commit_rows(
            runs, batch.seq_lens, self.block, self.device
        )
        ct.end = time.perf_counter() - t0
        self.timeline.add(ct)
        self._record(rows, ct)
        return GenerationBatchResult(
            logits_output=target_out.logits_output,
            next_token_ids=out_tokens,
            accept_lens=accept_lens,
            next_draft_input=D3DDraftInput(),
            can_run_cuda_graph=can_graph,
            speculative_num_draft_tokens=self.block,
            new_seq_lens=new_seq_lens,
        )

    def _verify(self, batch, rows, tokens: torch.Tensor, ct: CycleTimes, t0: float):
        """SGLang's target worker scores the block; acceptance runs on its device.
        -> (result, graph?, [(drafts accepted, next token)] per request)."""
        v0 = time.perf_counter()
        fb, can_graph = build_verify_forward_batch(batch, self.target_worker, tokens, self.block)
        out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=fb, is_verify=True
        )
        logits = out.logits_output.next_token_logits[:, : self.vocab_size]
        logits = logits.view(tokens.shape[0], self.block, -1)  # [bs, B, V], stays on device
        n, token = verify_batch(
            tokens[:, 1:].to(logits.device),
            logits,
            [s.params for s in rows],
            [s.draft_q for s in rows],  # None: a placeholder draft
            [s.generator for s in rows],
        )
        # The one device -> host copy of the cycle: two ints per request (waits for the pass).
        outcomes = [(a, t) for a, t in torch.stack([n, token], 1).tolist()]
        ct.verify_start, ct.verify_end = v0 - t0, time.perf_counter() - t0
        return out, can_graph, outcomes

    def _accept(self, rows, outcomes: list[tuple[int, int]], ct: CycleTimes) -> list[list[int]]:
        """Let the drafter follow each verified outcome. -> emitted runs per request."""
        drafts = [list(s.draft) for s in rows]  # `advance` replaces s.draft

        def follow():
            return [
                self.drafting.advance(s, n, t, self.block)
                for s, (n, t) in zip(rows, outcomes, strict=True)
            ]

        hits, _, _ = self.executor.submit(follow).result()
        runs = []
        for s, d, (n, t), hit in zip(rows, drafts, outcomes, hits, strict=True):
            ct.hits += hit is True
            ct.misses += hit is False
            s.last_cycle = (len(d), n, hit)
            run = d[:n] + [t]
            s.tokens.extend(run)
            runs.append(run)
        return runs

    def _record(self, rows, ct: CycleTimes) -> None:
        draft_time = ct.draft_end + (ct.predraft_end - ct.predraft_start)
        verify_time = ct.verify_end - ct.verify_start
        for s in rows:
            drafts, n, hit = s.last_cycle
            c = CycleStats(drafts, n, hit, draft_time, verify_time, ct.end, ct.overlap)
            s.stats.add_cycle(c)
            for fn in self.cycle_listeners:
                fn(s.request_id, c)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _abort(req, reason: str) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    log.warning(reason)
    req.to_finish = FINISH_ABORT(reason)


def _draft_device(options: PluginOptions, target: torch.device, gpu_id: int) -> torch.device:
    if options.draft_device:
        return torch.device(options.draft_device)
    if target.type == "cuda" and target.index is None:
        return torch.device("cuda", gpu_id)
    return target


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name) if name else None
