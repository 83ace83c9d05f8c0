"""Helpers for engine tests: building engines over the tiny models, and an oracle drafter."""

from __future__ import annotations

import torch

from sglang_d3d.config import BranchPolicy, EngineConfig, Mode, SpecConfig
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.speculative.tree import DraftTree
from sglang_d3d.testing import TINY_EOS

# Modes that run over any drafter; fused runs drafter and target as one model, so it needs a
# full-depth drafter (the "production" layout: tiny_prod_models).
SEPARATE_MODES = [m for m in Mode if m is not Mode.FUSED]


# A prompt with no token twice: its own text has no copy at first (copies from elsewhere).
WANDERS = [12, 40, 13, 50, 14, 60, 15]


def first_cycle(eng: SpecEngine, prompt: list[int], params):
    """(the request's output, the CycleStats of its first cycle), served alone."""
    from sglang_d3d.engine.offline import generate

    stats = []
    eng.cycle_listeners.append(lambda rid, c: stats.append(c))
    out = generate(eng, [prompt], params)[0]
    eng.cycle_listeners.clear()
    return out, stats[0]


def chain_tree(drafts: list[int]) -> DraftTree:
    """A chain of drafts as a tree (each node the child of the one before)."""
    n = len(drafts)
    return DraftTree(tuple(drafts), tuple(range(n)), tuple(range(1, n + 1)))


def mode_layouts(layouts: list[str]) -> list[tuple[str, Mode]]:
    """(layout, mode) pairs a test can run: fused only over the full-depth layout."""
    return [(lay, m) for lay in layouts for m in Mode if m is not Mode.FUSED or lay == "production"]


def make_engine(models, mode: Mode, block: int = 4, policy=BranchPolicy.TOPK, budget: int = 4,
                guesses: int = 1, batch: int = 4, context: int = 256, eos_token_ids=(),
                grammars=None, **kw) -> SpecEngine:
    _, target, drafter = models
    cfg = EngineConfig(
        mode=mode, spec=SpecConfig(block, policy, budget, guesses), max_batch_size=batch,
        max_context=context, **kw,
    )
    return SpecEngine(cfg, target, drafter if mode is not Mode.AR else None, eos_token_ids,
                      grammars)


def _anchor(pack, block: list[int]) -> int:
    """The clean token a block hangs off: the last non-mask index its first slot can see."""
    from sglang_d3d.models.drafter import MASK_ID

    return max(i for i in pack.sees[block[0]] if pack.input_ids[i] != MASK_ID)


class OracleDrafter:
    """Wraps an engine's DraftRunner: the real pass runs (so the drafter's KV bookkeeping is
    exercised), then its block logits are replaced by the target's true greedy continuation
    of the block's context, corrupted on a fixed schedule so that every verification outcome
    occurs: full acceptance, rejection with a correctable guess (the true token ranked second,
    so the branch hits), and rejection with an unguessable token (a miss)."""

    def __init__(self, engine: SpecEngine, hf_model, scale: float = 1.0) -> None:
        self.engine, self.hf = engine, hf_model
        self.scale = scale  # sharpens the proposal q when requests sample at high temperature
        self.runner = engine.drafting.runner
        self.real_run = self.runner.run
        self.runner.run = self.run
        self.calls = 0
        # (context, n) -> the target's greedy continuation: the same few contexts recur across
        # a test's many requests, and each continuation costs n uncached forwards
        self._greedy_memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(self, rows):
        contexts = [self._contexts(slot, pack) for slot, pack in rows]
        out = self.real_run(rows)
        return [self._oracle(lg, ctxs) for lg, ctxs in zip(out, contexts)]

    def _contexts(self, slot, pack) -> list[list[int]]:
        seq = next(s for s in self.engine.scheduler.running if s.slot == slot)
        committed = seq.tokens[: self.runner.lengths[slot]]
        ctxs = []
        for block in pack.blocks:
            anchor = _anchor(pack, block)
            visible = [i for i in pack.sees[anchor] if i <= anchor]
            ctxs.append(committed + [pack.input_ids[i] for i in visible])
        return ctxs

    def _oracle(self, logits: torch.Tensor, contexts: list[list[int]]) -> torch.Tensor:
        out = torch.full_like(logits, -10.0)
        for b, ctx in enumerate(contexts):
            self.calls += 1
            truth = self._greedy(ctx, logits.shape[1])
            for j, tok in enumerate(truth):
                out[b, j, tok] = 5.0
                kind = (self.calls + j) % 7
                if j >= 1 and kind == 0:  # wrong draft, truth ranked second: a hit
                    out[b, j, (tok + 1) % logits.shape[-1]] = 9.0
                elif j >= 1 and kind == 3:  # wrong draft, truth ranked low: a miss
                    out[b, j, (tok + 1) % logits.shape[-1]] = 9.0
                    out[b, j, (tok + 2) % logits.shape[-1]] = 8.0
                    out[b, j, tok] = -5.0
        return out * self.scale

    @torch.no_grad()
    def _greedy(self, ctx: list[int], n: int) -> list[int]:
        key = (tuple(ctx), n)
        if key not in self._greedy_memo:
            ids, out = list(ctx), []
            for _ in range(n):
                tok = int(self.hf(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
            self._greedy_memo[key] = out
        return list(self._greedy_memo[key])


def assert_follows(counts: torch.Tensor, exact: torch.Tensor, n: int) -> None:
    """Observed outcome counts against the exact law (same shape) over n draws: chi-square
    over the cells expected at least 5 times (the usual validity rule), the rest pooled, and
    nothing ever seen where the law has no mass."""
    expected = exact * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(keep.sum())  # cells - 1, plus the pooled cell
    # A loose bound: mean dof, sd sqrt(2 dof); 5 sd is a one-in-millions false alarm.
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
    assert counts[~(exact > 0)].sum() == 0


def finished_whole(record: dict, max_new: int, eos: int = TINY_EOS) -> bool:
    """A sampled request from the cpu_harness ran to its end: no error, and either all `max_new`
    tokens or a stop on the tiny models' end-of-sequence token with nothing after it. Sampling may draw eos on one CPU and not another, since their sums round apart."""
    ids = record["ids"]
    if record["error"] is not None or not ids or len(ids) > max_new:
        return False
    if record["reason"] == "length":
        return len(ids) == max_new and eos not in ids[:-1]
    return record["reason"] == "stop" and eos not in ids[:-1] and (ids[-1] == eos or len(ids) < max_new)
