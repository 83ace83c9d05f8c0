"""The worker's cycle without SGLang: which cycle a batch runs, with every verify block exactly
as wide as the one SGLang reserved KV slots and positions for, and what tensor-parallel ranks
take from rank 0.

Kept apart from worker.py (which imports sglang) so that the worker's contract runs anywhere:
`tests/test_sglang_worker_contract.py` drives it on CPU and CUDA with a verify function that
refuses any other width, as SGLang's verify view does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_d3d.speculative.cycle import (
    Outcome,
    Plan,
    Row,
    Verdict,
    VerifyFn,
    padded,
    run_copy_cycle,
    run_cycle,
)
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor
from sglang_d3d.speculative.lookup import CopySource


def worker_cycle(
    rows: Sequence[Row],
    drafting: Drafting,
    verify: VerifyFn,  # (rows, tokens [N, plan.block], proposals) -> Verdicts
    executor: Executor,
    plan: Plan,
    copy_ngram: int,
    elsewhere: Sequence[CopySource] = (),
    step: int = 0,
) -> list[Outcome]:
    """Greedy batches whose every row repeats its own text (or finds a copy in the drafter's
    corpus, `elsewhere`) verify copies with no drafter pass; others run the D3D cycle."""
    copies = Drafting.copies([drafting.states[r.slot] for r in rows], plan.block - 1, copy_ngram,
                             elsewhere)
    if copies is None:
        return run_cycle(rows, drafting, verify, executor, plan, step)
    # A corpus continuation may stop early (the end of an answer); SGLang reserved KV and built
    # positions for `block` tokens per row, so every row is that wide.
    copies = [padded(c, plan.block - 1) for c in copies]
    return run_copy_cycle(rows, drafting, verify, copies, step)


def from_rank0(t: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """Rank 0's copy of `t` on every tensor-parallel rank, as SGLang's DFlash worker syncs its
    decisions (speculative/spec_tp_sync.py). Each rank runs its own drafter and draws its own
    random numbers, so blocks and verdicts may differ between ranks; the ranks' target passes
    and commits must not. `group`: SGLang's tensor-parallel GroupCoordinator (None: one rank,
    `t` itself). Broadcast on `device` (NCCL takes device tensors, gloo host ones)."""
    if group is None:
        return t
    home = t.device
    t = t.to(device).contiguous()
    group.broadcast(t, src=0)
    return t.to(home)


def verdicts_of(
    tokens: torch.Tensor,  # [N, B] the block every rank verified (rank 0's)
    decided: torch.Tensor,  # [N, 2] drafts accepted, the target's token (rank 0's)
    parallel: bool,
) -> list[Verdict]:
    """One Verdict per row. Under tensor parallelism the accepted drafts are named as a path
    (rank 0's), so every rank commits, and its drafter follows, the same tokens even where its
    own drafts differed."""
    rows = decided.tolist()
    if not parallel:
        return [Verdict(a, t) for a, t in rows]
    sent = tokens.tolist()
    return [Verdict(a, t, path=tuple(sent[i][1 : 1 + a])) for i, (a, t) in enumerate(rows)]


def check_width(tokens, block: int) -> None:
    """SGLang's verify input (positions, KV slots, fa3's metadata) is `block` wide per row."""
    if tokens.shape[1] != block:
        raise ValueError(f"verify block of {tokens.shape[1]} tokens, SGLang reserved {block}")
