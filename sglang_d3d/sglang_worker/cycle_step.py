"""The worker's cycle without SGLang: which cycle a batch runs, with every verify block exactly
as wide as the one SGLang reserved KV slots and positions for.

Kept apart from worker.py (which imports sglang) so that the worker's contract runs anywhere:
`tests/test_sglang_worker_contract.py` drives it on CPU and CUDA with a verify function that
refuses any other width, as SGLang's verify view does.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_d3d.speculative.cycle import (
    Outcome,
    Plan,
    Row,
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


def check_width(tokens, block: int) -> None:
    """SGLang's verify input (positions, KV slots, fa3's metadata) is `block` wide per row."""
    if tokens.shape[1] != block:
        raise ValueError(f"verify block of {tokens.shape[1]} tokens, SGLang reserved {block}")
