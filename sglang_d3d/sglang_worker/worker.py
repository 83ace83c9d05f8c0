"""D3DWorker: SGLang's speculative worker for --speculative-algorithm D3D.

One `forward_batch_generation` call is one D3D cycle for every running request: after bringing
each request's drafter state up to SGLang's record of it, the embedded engine's own cycle
(speculative/cycle.py: draft -> verify beside pre-drafting -> follow) with SGLang's target as
the verifier (or, where every request is greedy and repeats its own text or finds a copy in
the drafter's corpus, a block copied from that text, with no drafter pass: speculative/lookup.py
and corpus_lookup.py, SGLANG_D3D_COPY_NGRAM and SGLANG_D3D_CORPUS_TOKENS):

    verify   SGLang's target worker, TARGET_VERIFY mode, its KV pool and radix cache; then
             speculative/verify.py over the whole batch on the target's device (greedy, or
             rejection sampling); only accepted counts and next tokens reach the host
    commit   the accepted runs go back to SGLang (verify_io.py)

Prefill batches go to the target worker unchanged; the drafter reads a new prompt in its first
draft, as the embedded engine does.
The drafter (sglang_d3d.models.drafter) keeps its own KV cache and never reads the target's
hidden states; drafting and branch policy are the embedded engine's own code
(speculative/drafting.py).
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_d3d.config import Mode
from sglang_d3d.sglang_worker import torch_native_verify
from sglang_d3d.sglang_worker.accept import unsupported_reason
from sglang_d3d.sglang_worker.counters import Counters, count_calls, layer_copies
from sglang_d3d.sglang_worker.cycle_step import check_width, from_rank0, verdicts_of, worker_cycle
from sglang_d3d.sglang_worker.draft_input import D3DDraftInput
from sglang_d3d.sglang_worker.drafter_loading import (
    build_drafter,
    build_shared_drafter,
    is_full_depth,
    placement,
    shared_target_weights,
)
from sglang_d3d.sglang_worker.fused_cycle import FusedCycle
from sglang_d3d.sglang_worker.load_plan import AUTO_KINDS, FUSED, PLAIN, SPEC, LoadPlan
from sglang_d3d.sglang_worker.memory import (
    MAX_FREE_SHARE,
    MAX_POOL_SHARE,
    CacheShape,
    TargetShape,
    cache_shape,
    check_cache,
    pool_budget,
    shared_plan,
)
from sglang_d3d.sglang_worker.options import PluginOptions
from sglang_d3d.sglang_worker.pool_draft import GATHER_BYTES, PoolDrafter, own_bytes
from sglang_d3d.sglang_worker.requests import RequestRow, RequestTable
from sglang_d3d.sglang_worker.shared_cycle import SharedCycle
from sglang_d3d.sglang_worker.shared_layers import fused_layers
from sglang_d3d.sglang_worker.validation import DEFAULT_MAX_RUNNING_REQUESTS, check_vocab
from sglang_d3d.sglang_worker.verify_io import (
    build_verify_forward_batch,
    commit_rows,
    is_torch_native,
)
from sglang_d3d.speculative.corpus_lookup import corpus_index
from sglang_d3d.speculative.cycle import Plan, record
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor
from sglang_d3d.speculative.listeners import Listeners
from sglang_d3d.speculative.penalties import reshape_rows
from sglang_d3d.speculative.timeline import Timeline
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
        # Concrete devices ("cuda:N", never a bare "cuda"), so that "same device" compares true.
        self.device, self.draft_device = placement(runner.device, self.options.draft_device, gpu_id)
        self.plan = Plan(self.block, self.options.mode is Mode.ASYNC)
        parallel = get_parallel()
        self.tp_group = parallel.tp_group if parallel.tp_size > 1 else None
        self.counters = Counters()
        self._raw = Counters()  # every call of the wrapped SGLang methods, cycles or not
        self._wrapped = False
        drafter_path = get_spec().speculative_draft_model_path
        hf_cfg = runner.model_config.hf_config
        self.shared = (is_full_depth(drafter_path, hf_cfg.num_hidden_layers)
                       and self.draft_device == self.device and parallel.tp_size == 1)
        if self.shared:
            self._init_shared(runner, drafter_path)
        else:
            self._init_own(runner)

    def _init_shared(self, runner, drafter_path: str) -> None:
        """A full-depth drafter on the target's device: SGLang's weights and KV pool
        (pool_draft.py, shared_cycle.py). The pool is made after this worker, so the cycle
        is built on the first decode batch."""
        embed, head = shared_target_weights(runner.model, self.vocab_size, 1, self.device,
                                            self.draft_device)
        if embed is None:
            raise ValueError("SGLang's embedding and LM head cannot be shared (quantised or "
                             "padded below the vocabulary); serve an unquantised target")
        self.drafter = build_shared_drafter(drafter_path, runner.model_config.hf_config,
                                            runner.model, self.device, embed, head)
        self.counters.drafter_bytes = own_bytes(self.drafter)
        self._check_shared_plan(runner, embed.element_size())
        self.counters.drafter_shares_target = True
        self.counters.target_layer_copies = layer_copies(self.drafter.layers, runner.model)
        self.shared_cycle: SharedCycle | None = None
        self.fused_cycle: FusedCycle | None = None
        # auto, and async (whose pre-drafting needs a drafter with its own cache): the plan
        # per load; sync: every cycle speculates, fused: every cycle is one fused forward.
        # Narrowed at the first cycle to what the attention backend runs.
        fixed = self.options.mode in (Mode.SYNC, Mode.FUSED)
        self.plan_per_load = not fixed or self.options.plan_per_load
        self.every = FUSED if self.options.mode is Mode.FUSED else SPEC
        self.load_plan = LoadPlan(kinds=AUTO_KINDS)
        self._last_cycle = None
        self._prefill_since = False
        log.info(
            "D3D worker: block %d, full-depth drafter on SGLang's own layers and KV pool "
            "(no drafter cache, no drafter prefill); its own tensors %.1f MB",
            self.block, self.counters.drafter_bytes / 1e6,
        )

    def _check_shared_plan(self, runner, dtype_bytes: int) -> None:
        """On a GPU: refuse, naming the flag, a plan (memory.shared_plan) that does not fit."""
        if self.device.type != "cuda":
            return
        cfg = runner.model_config.hf_config
        params = sum(p.numel() for p in runner.model.parameters())
        slots = int(get_schedule().max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS)
        plan = shared_plan(TargetShape.from_hf(cfg, params, dtype_bytes),
                           torch.cuda.get_device_properties(self.device).total_memory,
                           float(get_schedule().mem_fraction_static),
                           int(runner.model_config.context_len), slots, self.block,
                           self.drafter.cfg.adapter_rank, GATHER_BYTES)
        if not plan.fits:
            raise MemoryError(plan.problem)
        log.info("D3D memory plan: drafter's own %.2f GB, draft scratch %.2f GB, verify buffers "
                 "%.2f GB, KV pool about %d tokens", plan.drafter_own / 2**30,
                 plan.draft_scratch / 2**30, plan.verify_buffers / 2**30, plan.kv_tokens)

    def _init_own(self, runner) -> None:
        """A drafter that is not full depth (or on another device, or under tensor
        parallelism) runs its own layers' copy and cache (speculative/drafting.py)."""
        if self.options.mode is Mode.FUSED:
            raise ValueError("SGLANG_D3D_MODE=fused puts the drafter's mask rows into SGLang's "
                             "verify forward: it needs a full-depth drafter on the target's "
                             "device at --tp-size 1; use auto or sync")
        self.drafting = self._drafting(runner)
        # The drafter's corpus of the target's answers, for greedy batches' copies (or None).
        corpus = (corpus_index(self.drafting.runner.model, self.options.corpus_tokens)
                  if self.options.copy_ngram else None)
        self.elsewhere = () if corpus is None else (corpus,)
        num_slots = len(self.drafting.runner.lengths)
        self.table = RequestTable(self.drafting, num_slots, self.vocab_size)
        self.executor = Executor(self.draft_device)
        self.timeline = Timeline(maxlen=10_000)
        self._steps = 0  # cycles run; the timeline keeps only the last 10,000
        self.cycle_listeners = Listeners()  # fn(request_id, CycleStats), like SpecEngine's
        cache = self.drafting.runner.cache
        model = self.drafting.runner.model
        cache_bytes = 2 * cache.k.numel() * cache.k.element_size()  # K and V
        layer_bytes = sum(p.numel() * p.element_size() for layer in model.layers
                          for p in layer.parameters())
        self.counters.drafter_bytes = cache_bytes + layer_bytes
        self.counters.target_layer_copies = layer_copies(model.layers, runner.model)
        why = ("it is not full depth" if self.draft_device == self.device
               else f"it runs on {self.draft_device}")
        log.warning(
            "D3D worker: block %d, mode %s, drafter on %s with its own copy of %d target layers "
            "(%.2f GB) and its own cache for %d slots (%.2f GB), because %s; it prefills every "
            "prompt again",
            self.block, self.options.mode.value, self.draft_device, model.num_layers,
            layer_bytes / 1e9, num_slots, cache_bytes / 1e9,
            why if self.tp_group is None else "tensor parallelism shards the target",
        )  # fmt: skip

    def _drafting(self, runner) -> Drafting:
        dtype = _dtype(self.options.draft_dtype) or runner.dtype
        embed, head = shared_target_weights(runner.model, self.vocab_size, get_parallel().tp_size,
                                            self.device, self.draft_device)
        drafter = build_drafter(
            get_spec().speculative_draft_model_path,
            get_model().model_path,
            self.draft_device,
            dtype,
            embed,
            head,
        )
        # Allocated now, before SGLang sizes its KV pool from the memory left: the limit is the
        # one resolve_server_args declared (or the user's), never SGLang's pool-sized default.
        slots = int(get_schedule().max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS)
        spec = self.options.spec_config(self.block)
        context = runner.model_config.context_len
        self._check_cache_fits(runner, cache_shape(drafter, slots, context, spec))
        return Drafting.create(drafter, slots, context, spec)

    def _check_cache_fits(self, runner, shape: CacheShape) -> None:
        """Refuse, naming the flags, a drafter cache that SGLang's KV pool cannot spare
        (memory.py); on the target's GPU the budget is what SGLang would give its pool."""
        if self.draft_device.type != "cuda":
            return
        torch.cuda.empty_cache()  # as SGLang measures: cached blocks count as free
        free, _ = torch.cuda.mem_get_info(self.draft_device)
        if self.draft_device != self.device:
            check_cache(shape, free, MAX_FREE_SHARE)
            return
        pre_load = float(getattr(runner, "pre_model_load_memory", 0.0)) * (1 << 30)  # GB there
        budget = pool_budget(free, pre_load, float(get_schedule().mem_fraction_static))
        check_cache(shape, budget, MAX_POOL_SHARE)

    # ---- SGLang's entry point ------------------------------------------------------------
    def forward_batch_generation(
        self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ):
        self._wrap_sglang()
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            result = self._prefill(batch)
        elif batch.forward_mode.is_idle():
            result = self._idle()
        else:
            before = (self._raw.target_passes, self._raw.metadata_plans, time.perf_counter())
            result = self._shared_cycle(batch) if self.shared else self._cycle(batch)
            self._count_cycle(batch, before)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        if self.shared:
            if self.shared_cycle is not None:
                self.shared_cycle.release(rid)
            return
        row = self.table.rows.get(rid)
        if row is not None and row.stats.num_cycles:
            st = row.stats
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
        if self.shared and self.fused_cycle is not None:
            self.fused_cycle.forget()  # a mixed batch may advance a running request
        result = self.target_worker.forward_batch_generation(batch)
        self._prefill_since = True  # the next cycle's rate would count this prefill's time
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
        for row, req in zip(rows, batch.reqs, strict=True):
            known = len(row.state.tokens)
            self.table.sync(row, req)
            # What the drafter has not read yet, it prefills in this cycle's draft.
            self.counters.drafter_prefill_tokens += max(len(row.state.tokens) - known, 0)
        self._steps += 1
        target = {}  # SGLang's verify result, for the batch result

        def verify(rows, tokens, proposals):
            target["out"], target["graph"], verdicts = self._verify(batch, rows, tokens, proposals)
            return verdicts

        outcomes = worker_cycle(rows, self.drafting, verify, self.executor, self.plan,
                                self.options.copy_ngram, self.elsewhere, self._steps)
        out_tokens, accept_lens, new_seq_lens = commit_rows(
            [o.tokens for o in outcomes], batch.seq_lens, self.block, self.device
        )
        self.timeline.add(outcomes[0].times)
        self.counters.tokens_emitted += sum(len(o.tokens) for o in outcomes)
        for row, o in zip(rows, outcomes, strict=True):
            record(row.rid, row.stats, o, self.cycle_listeners)
        return GenerationBatchResult(
            logits_output=target["out"].logits_output,
            next_token_ids=out_tokens,
            accept_lens=accept_lens,
            next_draft_input=D3DDraftInput(),
            can_run_cuda_graph=target["graph"],
            speculative_num_draft_tokens=self.block,
            new_seq_lens=new_seq_lens,
        )

    def _shared_cycle(self, batch) -> GenerationBatchResult:
        if self.shared_cycle is None:
            runner = self.target_worker.model_runner
            pool = PoolDrafter(self.drafter, runner.token_to_kv_pool,
                               runner.req_to_token_pool.req_to_token, self.block,
                               fused_layers(self.drafter, runner.model))
            self.shared_cycle = SharedCycle(pool, self.target_worker, self.vocab_size,
                                            self.counters)
            self._narrow_to_backend(runner)
            if self.every == FUSED or (self.plan_per_load and FUSED in self.load_plan.kinds):
                self.fused_cycle = FusedCycle(self.shared_cycle, pool.fused, runner.model,
                                              self.options.branch_budget)
        kind = self._plan_cycle(batch)
        if kind == PLAIN:
            self.counters.plain_steps += 1
            self.counters.plain_requests += len(batch.reqs)
        if kind == FUSED:
            out, run, accept_lens = self.fused_cycle.run(batch, self.device)
        else:
            if self.fused_cycle is not None:
                self.fused_cycle.forget()
            out, run, accept_lens = self.shared_cycle.run(batch, self.device,
                                                          plain=kind == PLAIN)
        return GenerationBatchResult(
            logits_output=out.logits_output,
            next_token_ids=run.reshape(-1),
            accept_lens=accept_lens,
            next_draft_input=D3DDraftInput(),
            can_run_cuda_graph=False,
            speculative_num_draft_tokens=self.block,
            new_seq_lens=batch.seq_lens + accept_lens.to(batch.seq_lens.dtype),
        )

    def _narrow_to_backend(self, runner) -> None:
        """Plain cycles verify one token and fused ones put mask rows beside the verify rows:
        both only where the verify pass is this plugin's (torch_native_verify.py)."""
        if is_torch_native(runner.attn_backend):
            return
        if self.every == FUSED:
            log.warning("D3D: SGLANG_D3D_MODE=fused needs torch_native attention here (the "
                        "fused forward's mask rows); every cycle drafts, then verifies")
            self.every = SPEC
        if self.plan_per_load:
            log.info("D3D plan per load: every cycle speculates (plain and fused cycles need a "
                     "verify of any width, which this attention backend does not take)")
            self.plan_per_load = False

    # ---- the plan per load (load_plan.py) -------------------------------------------------
    def _plan_cycle(self, batch) -> str:
        """Settle the previous cycle's rate (tokens SGLang committed since, over the time
        between the two cycles' starts, scheduler included), then choose this one's kind."""
        now, reqs = time.perf_counter(), batch.reqs
        last = self._last_cycle
        if last is not None and not self._prefill_since:
            kind, size, start, lens = last
            tokens = sum(len(r.output_ids) - lens[r.rid] for r in reqs if r.rid in lens)
            self.load_plan.record(size, kind, tokens, now - start)
        kind = self.load_plan.choose(len(reqs)) if self.plan_per_load else self.every
        self._last_cycle = (kind, len(reqs), now, {r.rid: len(r.output_ids) for r in reqs})
        self._prefill_since = False
        return kind

    # ---- counters ------------------------------------------------------------------------
    def _wrap_sglang(self) -> None:
        """Count SGLang's target passes and attention-metadata plans (counters.py). Done at
        the first batch: the attention backend is made after this worker."""
        if self._wrapped:
            return
        runner = self.target_worker.model_runner
        if is_torch_native(runner.attn_backend):
            torch_native_verify.install(runner.attn_backend)
        count_calls(runner, "forward", self._raw, "target_passes")
        count_calls(runner.attn_backend, "init_forward_metadata", self._raw, "metadata_plans")
        self._wrapped = True

    def _count_cycle(self, batch, before: tuple[int, int, float]) -> None:
        c = self.counters
        c.cycle_s += time.perf_counter() - before[2]
        c.cycles += 1
        c.requests_cycled += len(batch.reqs)
        c.target_passes += self._raw.target_passes - before[0]
        c.metadata_plans += self._raw.metadata_plans - before[1]
        c.write()

    def _verify(self, batch, rows: list[RequestRow], tokens: torch.Tensor, proposals: list):
        """SGLang's target worker scores the block [bs, B]; acceptance runs on its device.
        -> (result, graph?, a Verdict per request)."""
        check_width(tokens, self.block)
        tokens = from_rank0(tokens, self.tp_group, self.device)  # one block for every rank
        fb, can_graph = build_verify_forward_batch(batch, self.target_worker, tokens, self.block)
        out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=fb, is_verify=True
        )
        logits = out.logits_output.next_token_logits[:, : self.vocab_size]
        logits = logits.view(tokens.shape[0], self.block, -1)  # [bs, B, V], stays on device
        drafts = tokens[:, 1:].to(logits.device)  # [bs, B-1]
        n, token = verify_batch(
            drafts,
            reshape_rows(logits, drafts, rows, [r.state.params for r in rows]),
            [r.state.params for r in rows],
            proposals,  # None: a placeholder draft
            [r.verify_random for r in rows],  # verification's own streams (accept.Role)
        )
        # The one device -> host copy of the cycle: two ints per request (waits for the pass).
        decided = from_rank0(torch.stack([n, token], 1), self.tp_group, self.device)
        return out, can_graph, verdicts_of(tokens, decided, self.tp_group is not None)

    def shutdown(self) -> None:
        if not self.shared:
            self.executor.shutdown()


def _abort(req, reason: str) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    log.warning(reason)
    req.to_finish = FINISH_ABORT(reason)


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name) if name else None
