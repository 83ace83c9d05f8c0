"""The SGLang worker's request table: our drafting state kept beside SGLang's requests. SGLang's
Req is stood in for by its fields the table reads (no sglang import needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_d3d.config import SpecConfig
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.sglang_worker.requests import RequestTable
from sglang_d3d.speculative.drafting import Drafting

BLOCK = 4


def _req(rid: str, prompt: list[int]):
    sp = SimpleNamespace(top_k=1, temperature=0.0, top_p=1.0, sampling_seed=None, max_new_tokens=8,
                         frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None)
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, output_ids=[prompt[-1]], sampling_params=sp)


@pytest.fixture
def table(tiny_models):
    drafting = Drafting(DraftRunner(tiny_models[2], 2, 128), SpecConfig(block_size=BLOCK))
    return RequestTable(drafting, num_slots=2, vocab_size=96)


def _step(table, reqs):
    rows = table.rows_for(reqs)
    for row, req in zip(rows, reqs):
        table.sync(row, req)
    table.drafting.ensure_drafts([r.state for r in rows], BLOCK)  # the drafter reads each prompt into its slot
    return rows


def test_a_full_table_evicts_only_requests_that_left(table):
    """Eviction once ran while the batch was being walked, so a new request at the front
    of a full batch evicted every request not reached yet, live ones included."""
    a, b, c = _req("a", [5, 6, 7]), _req("b", [9, 10, 11]), _req("c", [3, 4])
    _, b_row = _step(table, [a, b])
    b_cached = table.drafting.runner.lengths[b_row.slot]
    assert b_cached > 0
    # `a` left without a finish notice (aborted in SGLang); `c` arrives ahead of `b`
    c_row, b_again = table.rows_for([c, b])
    assert b_again is b_row and table.drafting.runner.lengths[b_row.slot] == b_cached
    assert set(table.rows) == {"b", "c"} and c_row.slot != b_row.slot


def test_more_live_requests_than_slots_is_refused_with_the_flag_to_change(table):
    with pytest.raises(RuntimeError, match="--max-running-requests"):
        table.rows_for([_req("a", [5]), _req("b", [6]), _req("c", [7])])


def test_finished_requests_give_their_slot_back(table):
    _step(table, [_req("a", [5, 6]), _req("b", [7, 8])])
    table.release("a")
    (row,) = table.rows_for([_req("c", [3, 4])])
    assert table.drafting.runner.lengths[row.slot] == 0  # the slot's old cache is forgotten
    assert set(table.rows) == {"b", "c"}


def test_drafting_and_verification_draw_from_streams_of_their_own(table):
    """Verification's uniforms must not repeat the drafter's draws when the two run on
    different devices (test_sglang_random.py has the chi-square)."""
    (row,) = table.rows_for([_req("a", [5, 6])])
    assert row.verify_random is not row.state.generator
    assert row.verify_random.seed != row.state.generator.seed


def test_sync_reads_only_the_tokens_past_those_the_drafter_knows(table):
    """Each cycle hands the drafter SGLang's new tokens alone; a record that disagrees with
    the drafter's at its ends is read afresh."""
    req = _req("a", [5, 6, 7])
    (row,) = table.rows_for([req])
    skipped, restarted = [], []
    skip, restart = table.drafting.skip, table.drafting.restart
    table.drafting.skip = lambda s, new: (skipped.append(list(new)), skip(s, new))
    table.drafting.restart = lambda s, full: (restarted.append(list(full)), restart(s, full))
    table.sync(row, req)
    assert skipped == [[5, 6, 7, 7]] and row.state.tokens == [5, 6, 7, 7]
    req.output_ids += [8, 9]
    table.sync(row, req)
    table.sync(row, req)  # nothing new
    assert skipped == [[5, 6, 7, 7], [8, 9]] and row.state.tokens == [5, 6, 7, 7, 8, 9]
    req.output_ids[-1] = 4  # rewritten where the drafter's record ends
    table.sync(row, req)
    assert restarted == [[5, 6, 7, 7, 8, 4]] and row.state.tokens == [5, 6, 7, 7, 8, 4]
    req.output_ids[:] = [1]  # shorter than the drafter's record
    table.sync(row, req)
    assert restarted[-1] == [5, 6, 7, 1] and row.state.tokens == [5, 6, 7, 1]
