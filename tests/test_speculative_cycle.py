"""The one speculative cycle both hosts run (speculative/cycle.py), with a stand-in verifier:
outcomes carry what to emit and the stats, and the drafter follows each verdict."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.config import SamplingParams, SpecConfig
from sglang_d3d.speculative.cycle import Plan, Verdict, record, run_cycle
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor
from sglang_d3d.speculative.listeners import Listeners
from sglang_d3d.speculative.sampling import make_generator, sample, sample_rows
from sglang_d3d.speculative.stats import RequestStats

BLOCK = 4


@pytest.fixture
def setup(tiny_models):
    drafting = Drafting.create(tiny_models[2], 2, 128, SpecConfig(block_size=BLOCK))
    rows = [drafting.start(slot, p, SamplingParams(), make_generator(slot))
            for slot, p in enumerate([[5, 6, 7], [9, 10]])]
    ex = Executor("cpu")
    yield drafting, rows, ex
    ex.shutdown()


def _verifier(seen, verdicts):
    def verify(rows, tokens, proposals):
        seen.append((tokens.clone(), list(proposals)))
        return verdicts
    return verify


@pytest.mark.parametrize("overlap", [False, True])
def test_outcomes_hold_the_run_and_the_drafter_follows(setup, overlap):
    drafting, rows, ex = setup
    seen = []
    verdicts = [Verdict(1, 42), Verdict(error="boom")]
    before = [list(r.tokens) for r in rows]
    outs = run_cycle(rows, drafting, _verifier(seen, verdicts), ex, Plan(BLOCK, overlap), step=7)
    (tokens, proposals), = seen
    assert tokens.shape == (2, BLOCK) and tokens[:, 0].tolist() == [7, 10]  # last token first
    assert all(q is not None and q.shape[0] == BLOCK for q in proposals)  # real drafts, with q
    ok, failed = outs
    assert ok.tokens == [int(tokens[0, 1]), 42] and ok.error is None
    assert (ok.stats.num_drafts, ok.stats.num_accepted) == (BLOCK - 1, 1)
    assert ok.stats.branch_hit is (False if overlap else None)  # 42 is no pre-drafted guess
    assert rows[0].tokens == before[0] + ok.tokens  # drafting keeps its own view
    assert failed.tokens == [] and failed.stats is None and failed.error == "boom"
    assert rows[1].tokens == before[1]  # a failed row is not followed
    t = ok.times
    assert t is failed.times and (t.step, t.batch, t.block) == (7, 2, BLOCK)
    assert 0 <= t.draft_end <= t.verify_start <= t.verify_end <= t.end
    assert (t.predraft_end > 0) == overlap


def test_a_cycle_without_drafts_only_queues_the_token(setup):
    drafting, rows, ex = setup
    seen = []
    outs = run_cycle(rows, drafting, _verifier(seen, [Verdict(0, 3), Verdict(0, 4)]), ex, Plan(1))
    assert seen[0][0].tolist() == [[7], [10]] and seen[0][1] == [None, None]
    assert [o.tokens for o in outs] == [[3], [4]]
    assert [o.stats.num_drafts for o in outs] == [0, 0]
    assert rows[0].pending[-1] == 3 and rows[0].draft is None


def test_target_only_rows_need_no_drafting(tiny_models):
    class Row:
        slot, last_token = 0, 11

    ex = Executor("cpu")
    try:
        (o,) = run_cycle([Row()], None, lambda r, t, q: [Verdict(0, 12)], ex, Plan(1))
    finally:
        ex.shutdown()
    assert o.tokens == [12] and o.faults == 0 and o.stats.branch_hit is None


def test_record_folds_outcomes_into_request_stats(setup):
    drafting, rows, ex = setup
    outs = run_cycle(rows, drafting, lambda r, t, q: [Verdict(2, 1), Verdict(error="x")], ex,
                     Plan(BLOCK))
    stats, heard = RequestStats(), []
    for o in outs:
        record("r", stats, o, Listeners([lambda rid, c: heard.append((rid, c.num_accepted))]))
    assert stats.num_cycles == 1 and stats.accepted_lengths == [3] and heard == [("r", 2)]


def test_one_sampler_for_one_draw_and_for_rows():
    probs = torch.softmax(torch.randn(96) * 3, -1)
    a, b = make_generator(4), make_generator(4)
    assert [sample(probs, a) for _ in range(5)] == [sample_rows(probs[None], b)[0] for _ in range(5)]


def test_sample_rows_draws_each_row_from_its_distribution():
    """Inverse-CDF draws: frequencies follow each row's probabilities, and a token of zero
    probability is never drawn."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0], [0.1, 0.6, 0.0, 0.3]])
    g, n = make_generator(7), 6000
    counts = torch.zeros_like(probs)
    for _ in range(n):
        for row, tok in enumerate(sample_rows(probs, g)):
            counts[row, tok] += 1
    assert counts[probs == 0].sum() == 0
    assert (counts / n - probs).abs().max() < 0.025  # about 4 standard errors at p = 0.5


def test_a_plan_verifies_trees_only_with_drafts_and_no_pre_drafting():
    assert Plan(4).verifies_trees(5)
    assert not Plan(4).verifies_trees(0)  # chains asked for
    assert not Plan(1).verifies_trees(5)  # plain decoding: no drafts
    assert not Plan(4, overlap=True).verifies_trees(5)  # branches are outcomes of a chain
