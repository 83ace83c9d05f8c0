"""Copies from earlier requests' text (speculative/shared_lookup.py,
`EngineConfig.shared_lookup_tokens`): the index alone, then in the engine."""

from __future__ import annotations

import pytest
from conftest import reference_greedy
from engine_helpers import WANDERS, first_cycle, make_engine

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.calibrate import CalibrationConfig, calibrate
from sglang_d3d.engine.offline import generate
from sglang_d3d.speculative.cycle import padded
from sglang_d3d.speculative.shared_lookup import TextIndex


# ---- the index --------------------------------------------------------------------------------
def test_the_latest_occurrence_gives_what_followed_it():
    idx = TextIndex(capacity=100, ngram=3)
    idx.add([1, 2, 3, 4, 5, 6])
    idx.add([9, 2, 3, 4, 7, 8])
    assert idx.continuation([0, 2, 3, 4], 2) == [7, 8]  # the later text wins
    assert idx.continuation([5, 6, 9, 2, 3], 3) == [4, 7, 8]


def test_a_copy_stops_at_the_end_of_its_text():
    idx = TextIndex(capacity=100, ngram=2)
    idx.add([1, 2, 3])
    idx.add([4, 5, 6])
    assert idx.continuation([1, 2], 5) == [3]  # not on into the next request's text
    assert idx.continuation([2, 3], 5) == []  # nothing followed within that text


def test_its_guesses_beside_another_copy_are_the_continuation_uncounted():
    idx = TextIndex(capacity=100, ngram=3)
    idx.add([1, 2, 3, 4, 5, 6])
    assert idx.guesses([0, 2, 3, 4], 2, 8) == [[5, 6]]
    assert idx.guesses([7, 7, 7], 2, 8) == [] and idx.guesses([2, 3, 4], 2, 0) == []
    assert (idx.lookups, idx.found) == (0, 0)  # the metrics count the copies it gave alone


def test_no_copy_without_a_match_or_room():
    idx = TextIndex(capacity=100, ngram=3)
    idx.add([1, 2, 3, 4])
    assert idx.continuation([7, 2, 3], 4) == []  # never occurred
    assert idx.continuation([2, 3], 4) == []  # shorter than the n-gram
    assert idx.continuation([1, 2, 3], 0) == []
    assert TextIndex(capacity=10).continuation([1, 2, 3], 4) == []  # empty


def test_no_n_gram_spans_two_texts():
    idx = TextIndex(capacity=100, ngram=2)
    idx.add([1, 2])
    idx.add([3, 4, 5])
    assert idx.continuation([2, 3], 3) == []  # 2 then 3 only across the boundary


def test_memory_stays_bounded_and_the_newest_text_stays():
    idx = TextIndex(capacity=50, ngram=3)
    idx.add([1000, 1001, 1002, 1003])
    for i in range(40):
        idx.add([10 * i + j for j in range(10)])
        assert len(idx) <= 2 * 50
        assert len(idx.after) <= len(idx)
    assert idx.continuation([1000, 1001, 1002], 1) == []  # the oldest text is gone
    assert idx.continuation([390, 391, 392], 2) == [393, 394]  # the newest is there


def test_clear_and_bad_sizes():
    idx = TextIndex(capacity=10)
    idx.add([1, 2, 3, 4])
    idx.clear()
    assert len(idx) == 0 and idx.continuation([1, 2, 3], 1) == []
    idx.add([1, 2, 3, 4])  # usable after clearing
    assert idx.continuation([1, 2, 3], 1) == [4]
    for capacity, n in ((0, 3), (10, 0)):
        with pytest.raises(ValueError, match="capacity and ngram"):
            TextIndex(capacity, n)
    with pytest.raises(ValueError, match="shared_lookup_tokens"):
        EngineConfig(shared_lookup_tokens=-1)


# ---- in the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_a_repeated_greedy_request_copies_the_earlier_answer(tiny_models, mode):
    """Served twice, a prompt's second answer starts as a copy of its first (which the index
    holds): the first cycle copies 8 tokens (4, where the cycle runs the short way,
    engine/copy_arms.py) and all are accepted. Outputs stay the target's."""
    params = SamplingParams(max_new_tokens=30)
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    eng = make_engine(tiny_models, mode, block=4, batch=1)
    first, before = first_cycle(eng, WANDERS, params)
    second, after = first_cycle(eng, WANDERS, params)
    assert first.token_ids == second.token_ids == ref
    assert not before.copied  # nothing to copy from yet
    assert after.copied and after.num_drafts == after.num_accepted
    assert after.num_drafts in (eng.cfg.lookup_tokens, eng.cfg.lookup_tokens // 2)


def test_off_means_no_copy_from_other_requests(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    assert eng.shared_text is None
    params = SamplingParams(max_new_tokens=30)
    first_cycle(eng, WANDERS, params)
    out, again = first_cycle(eng, WANDERS, params)
    assert out.token_ids == reference_greedy(tiny_models[0], WANDERS, 30)
    assert not again.copied


def test_a_seeded_sampled_request_draws_the_same_whatever_came_before(tiny_models):
    """Sampled rows never copy from other requests' text: served again, a seeded request
    finds its own earlier answer in the index and still does not copy it (its first cycle
    drafts), and draws what it drew the first time and what a server without the index draws."""
    sampled = SamplingParams(temperature=0.8, seed=3, max_new_tokens=30)
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1)
    first, _ = first_cycle(eng, WANDERS, sampled)
    again, cycle = first_cycle(eng, WANDERS, sampled)
    assert not cycle.copied
    off = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    assert first.token_ids == again.token_ids == generate(off, [WANDERS], sampled)[0].token_ids


def test_calibration_text_is_not_indexed(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, adaptive=True)
    calibrate(eng, CalibrationConfig(cycles=1, max_batch=2, prompt_len=8, stagger=2))
    assert eng.shared_text is not None and len(eng.shared_text) == 0
    out = generate(eng, [WANDERS], SamplingParams(max_new_tokens=10))[0]
    assert len(eng.shared_text) == len(WANDERS) + len(out.token_ids) + 1  # its text and end


def test_copies_of_different_lengths_share_one_verify_pass(tiny_models):
    """An earlier text may end a few tokens after the match, so one row's copy can be shorter
    than its neighbour's: it is padded for the pass, and the output stays the target's."""
    other = [20, 41, 22, 51, 24, 61, 25]  # wanders too
    ref = {tuple(p): reference_greedy(tiny_models[0], p, 20) for p in (WANDERS, other)}
    first, second = ref[tuple(WANDERS)], ref[tuple(other)]
    # verified as chains (as the SGLang worker does); trees of guesses pad with nodes never
    # accepted (test_tree.py's padding test)
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=2, copy_guesses=0)
    eng.shared_text.add([*WANDERS[-3:], *first[:3]])  # 2 tokens follow the match
    eng.shared_text.add([*other[-3:], *second])  # 19 follow
    stats = {}
    eng.cycle_listeners.append(lambda rid, c: stats.setdefault(rid, []).append(c))
    out = generate(eng, [WANDERS, other], SamplingParams(max_new_tokens=20))
    assert [o.token_ids for o in out] == [first, second]
    starts = [cycles[0] for cycles in stats.values()]  # both rows' first cycle: one pass
    assert all(c.copied and c.num_drafts == 8 for c in starts)
    guess = padded(first[1:3], 8)  # what the short row verified, against what it produced
    agree = next((i for i, (g, t) in enumerate(zip(guess, first[1:9])) if g != t), 8)
    assert sorted(c.num_accepted for c in starts) == sorted([agree, 8])


def test_a_short_copy_is_padded_with_its_last_token():
    assert padded([4, 5], 4) == [4, 5, 5, 5]
    assert padded([4, 5, 6], 3) == [4, 5, 6]
