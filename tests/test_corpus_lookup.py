"""Copies from the drafter's corpus of the target's own answers (speculative/corpus_lookup.py,
models/corpus.py, `d3d corpus`, `EngineConfig.corpus_tokens`): the index alone, the file, the
command, then in the engine."""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import pytest
from conftest import reference_greedy
from engine_helpers import WANDERS, first_cycle, make_engine

from sglang_d3d.cli import main as d3d
from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.corpus import (
    CorpusFormatError,
    first_tokens,
    pack_tokens,
    read_corpus,
    unpack_tokens,
    write_corpus,
)
from sglang_d3d.models.drafter import D3DDrafter, read_config
from sglang_d3d.speculative.corpus_lookup import (
    CorpusIndex,
    CorpusSetting,
    _table,
    corpus_index,
    hash_tokens,
)
from sglang_d3d.speculative.draft_state import DraftState
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.training.shards import Sample, write_manifest, write_shard


# ---- the index --------------------------------------------------------------------------------
def test_a_first_guess_whose_shortest_counted_context_never_occurred_is_settled_alike():
    """The gate (`_longest`: a context occurs only where its tail does) changes no answer:
    on small random corpora, every continuation equals the full walk over the orders."""
    def full_walk(index, ctx, min_order=1):  # every order, longest first, no gate
        for n in index.setting.orders:
            if min_order <= n <= len(ctx) and (found := index.tables[n].options(hash_tokens(ctx[-n:]))):
                return n, found
        return 0, []

    rng = np.random.default_rng(3)
    for setting in (CorpusSetting(), CorpusSetting(orders=(5, 3, 1), min_order=2, min_share=0.3)):
        corpus = [list(rng.integers(0, 5, size=int(rng.integers(5, 40)))) for _ in range(20)]
        gated, walked = CorpusIndex(corpus, setting), CorpusIndex(corpus, setting)
        walked._longest = lambda ctx, min_order=1, w=walked: full_walk(w, ctx, min_order)
        for _ in range(300):
            ctx = [int(t) for t in rng.integers(0, 6, size=int(rng.integers(0, 9)))]
            length = int(rng.integers(0, 6))
            assert gated.continuation(ctx, length) == walked.continuation(ctx, length), ctx


def test_the_likeliest_continuation_of_the_longest_context_is_guessed():
    # after [1, 2, 3]: 4 twice, 5 once; after [9, 2, 3] (a longer context of 3 that occurred): 5
    idx = CorpusIndex([[1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [1, 2, 3, 5], [9, 2, 3, 5, 7]])
    assert idx.continuation([0, 1, 2, 3], 2) == [4, 6]
    assert idx.continuation([9, 2, 3], 2) == [5, 7]  # its own longest context decides


def test_a_tie_goes_to_the_smaller_token_id():
    idx = CorpusIndex([[1, 2, 3, 8], [1, 2, 3, 7]])
    assert idx.continuation([1, 2, 3], 1) == [7]


def test_the_first_guess_needs_a_long_and_sure_enough_context():
    setting = CorpusSetting(min_order=3, min_share=0.5)
    idx = CorpusIndex([[1, 2, 3, 4], [5, 2, 3, 9], [5, 2, 3, 8], [5, 2, 3, 7]], setting)
    assert idx.continuation([6, 1, 2], 3) == []  # longest context [1, 2]: too short
    assert idx.continuation([5, 2, 3], 3) == []  # 7, 8 and 9 a third each: not sure enough
    assert idx.continuation([1, 2, 3], 1) == [4]  # 3 long and always 4
    loose = CorpusIndex([[5, 2, 3, 9], [5, 2, 3, 8], [5, 2, 3, 7]], CorpusSetting(min_share=0.3))
    assert loose.continuation([5, 2, 3], 1) == [7]


def test_later_guesses_follow_any_context_that_occurred():
    """The first guess opens the copy; after it, each guess takes the longest context that
    occurred, however short or unsure (the target verifies them all)."""
    idx = CorpusIndex([[1, 2, 3, 4], [9, 3, 4, 5], [8, 3, 4, 5], [7, 3, 4, 6]])
    # after [1, 2, 3, 4] only [3, 4] occurred with a token after it: 5 (2 of 3), 2 tokens long
    assert idx.continuation([1, 2, 3], 4) == [4, 5]
    assert idx.continuation([0, 3, 4], 4) == []  # the same context does not open a copy


def test_no_context_spans_two_answers():
    idx = CorpusIndex([[1, 2, 3], [4, 5, 6]], CorpusSetting(min_order=2))
    assert idx.continuation([2, 3], 2) == []  # 2, 3 then 4 only across the boundary
    assert idx.continuation([0], 2) == [] and idx.continuation([], 2) == []


def test_no_guess_without_room_or_corpus():
    idx = CorpusIndex([[1, 2, 3, 4]])
    assert idx.continuation([1, 2, 3], 0) == []
    empty = CorpusIndex([])
    assert len(empty) == 0 and empty.continuation([1, 2, 3], 4) == []


def test_counters_count_lookups_and_finds():
    idx = CorpusIndex([[1, 2, 3, 4]])
    idx.continuation([1, 2, 3], 2)
    idx.continuation([7, 8, 9], 2)
    idx.continuation([1, 2, 3], 0)  # no room: not a lookup
    assert (idx.lookups, idx.found, len(idx)) == (2, 1, 4)


def test_the_table_hashes_as_the_lookup_does_for_any_vocabulary():
    """Ids past 16 bits (Qwen3's 151k vocabulary) hash alike in the vectorised build and in
    the per-row lookup."""
    seq = [151_000, 70_000, 3, 149_999, 65_536, 1]
    flat = np.array([*seq, -1])
    table = _table(flat, 3)
    want = sorted(hash_tokens(seq[i : i + 3]) for i in range(len(seq) - 3))
    assert [int(k) for k in table.keys] == want
    idx = CorpusIndex([seq])
    assert idx.continuation(seq[:3], 3) == seq[3:]


def test_a_context_keeps_its_likeliest_next_tokens_and_their_shares():
    # after [1, 2, 3]: 4 three times, 5 twice, 6 and 7 once each; the top 3 are kept
    idx = CorpusIndex([[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5]] * 2 + [[1, 2, 3, 6], [1, 2, 3, 7]])
    options = idx.tables[3].options(hash_tokens([1, 2, 3]))
    assert [t for t, _ in options] == [4, 5, 6]
    assert [round(s, 3) for _, s in options] == [round(3 / 7, 3), round(2 / 7, 3), round(1 / 7, 3)]
    assert idx.tables[3].find(hash_tokens([1, 2, 3]))[0] == 4
    assert idx.tables[3].options(hash_tokens([3, 2, 1])) == []


def test_guesses_are_a_trees_likeliest_paths_best_first():
    """After [1, 2]: 3 (2 of 3, then always 4) or 5 (1 of 3, then 6). Best first by the
    product of shares: [3] and [3, 4] (2/3) before [5] and [5, 6] (1/3); parents first."""
    idx = CorpusIndex([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]])
    assert idx.guesses([1, 2], 2, 8) == [[3], [3, 4], [5], [5, 6]]
    assert idx.guesses([1, 2], 1, 8) == [[3], [5]]  # at most `length` deep
    assert idx.guesses([1, 2], 2, 3) == [[3], [3, 4], [5]]  # at most `nodes`
    assert idx.guesses([8, 9], 2, 8) == [] and idx.guesses([1, 2], 0, 8) == []
    assert (idx.lookups, idx.found) == (0, 0)  # beside a copy: not counted


def test_a_drafters_corpus_index_keeps_within_its_cap():
    """What both hosts build (the engine, the SGLang worker): none without a corpus or a cap."""
    class Drafter:
        corpus = [np.arange(1, 5), np.arange(10, 13)]

    assert len(corpus_index(Drafter(), 5)) == 4  # the second answer does not fit
    assert corpus_index(Drafter(), 0) is None
    assert corpus_index(object(), 100) is None


def test_a_batch_copies_from_the_corpus_only_where_every_greedy_row_has_a_copy():
    """The SGLang worker's cycles of copies (`Drafting.copies`): a row whose own text has
    none asks the corpus; the cycle copies only if every row found one and all are greedy."""
    idx = CorpusIndex([[1, 2, 3, 4, 5, 6]])

    def row(tokens, temperature=0.0):
        return DraftState(0, SamplingParams(temperature=temperature, seed=1), None, tokens, [])

    assert Drafting.copies([row([9, 1, 2, 3])], 3, 2) is None  # its own text has no copy
    assert Drafting.copies([row([9, 1, 2, 3])], 3, 2, [idx]) == [[4, 5, 6]]
    both = [row([7, 8, 7, 8]), row([9, 1, 2, 3])]  # its own text, the corpus
    assert Drafting.copies(both, 3, 2, [idx]) == [[7, 8, 7], [4, 5, 6]]
    assert Drafting.copies([row([9, 1, 2, 3]), row([0, 0, 0, 5])], 3, 2, [idx]) is None
    assert Drafting.copies([row([9, 1, 2, 3], 0.7)], 3, 2, [idx]) is None  # sampled: never


def test_row_copies_skip_greedy_rows_after_one_without_and_copy_sampled_rows_where_asked():
    """The engine's per-row copies (`Drafting.row_copies`): a greedy row after one without a
    copy is not looked up (its copy could serve no cycle of copies); a sampled row copies its
    own text only where the host verifies it as a tree of sure nodes (`sampled_too`)."""
    idx = CorpusIndex([[1, 2, 3, 4, 5, 6]])

    def row(tokens, temperature=0.0):
        return DraftState(0, SamplingParams(temperature=temperature, seed=1), None, tokens, [])

    rows = [row([0, 0, 0, 5]), row([9, 1, 2, 3]), row([7, 8, 7, 8], 0.7)]
    assert Drafting.row_copies(rows, 3, 2, [idx]) == [[], [], []]
    assert Drafting.row_copies(rows, 3, 2, [idx], sampled_too=True) == [[], [], [7, 8, 7]]
    assert Drafting.row_copies(rows[1:], 3, 2, [idx]) == [[4, 5, 6], []]
    assert Drafting.row_copies([row([9, 1, 2, 3], 0.7)], 3, 2, [idx], True) == [[]]  # own text only


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="longest first"):
        CorpusSetting(orders=(2, 3))
    with pytest.raises(ValueError, match="min_share"):
        CorpusSetting(min_share=1.5)
    with pytest.raises(ValueError, match="corpus_tokens -1"):
        EngineConfig(corpus_tokens=-1)


# ---- the file and the command -----------------------------------------------------------------
def test_a_corpus_reads_back_as_written(tmp_path):
    answers = [np.array([1, 2, 3]), np.array([70_000, 5]), np.array([], dtype=np.int64)]
    write_corpus(tmp_path, answers, "abc")
    got = read_corpus(tmp_path, "abc")
    assert [a.tolist() for a in got] == [[1, 2, 3], [70_000, 5], []]
    assert read_corpus(tmp_path / "nowhere", "abc") is None


def test_another_targets_corpus_or_a_broken_file_is_refused(tmp_path):
    write_corpus(tmp_path, [np.array([1, 2])], "abc")
    with pytest.raises(CorpusFormatError, match="another target's token ids"):
        read_corpus(tmp_path, "xyz")
    (tmp_path / "corpus.npz").write_bytes(b"not a zip")
    with pytest.raises(CorpusFormatError, match="not a corpus"):
        read_corpus(tmp_path, "abc")


def test_small_ids_pack_in_two_bytes_and_unpack_exactly():
    tokens = np.array([0, 1, 65_535, 49_151, 7])
    blob = pack_tokens(tokens, np.uint16)
    assert unpack_tokens(blob, "<u2").tolist() == tokens.tolist()
    assert len(lzma.decompress(blob)) == 2 * len(tokens)


def test_a_corpus_written_before_xz_still_reads(tmp_path):
    np.savez_compressed(tmp_path / "corpus.npz", tokens=np.array([4, 5, 6], np.uint16),
                        lengths=np.array([1, 2]), target_fingerprint=np.array("abc"))
    assert [a.tolist() for a in read_corpus(tmp_path, "abc")] == [[4], [5, 6]]


def test_a_corpus_with_a_broken_xz_payload_is_refused(tmp_path):
    np.savez(tmp_path / "corpus.npz", tokens_xz=np.frombuffer(b"garbage!", np.uint8),
             token_dtype=np.array("<u2"), lengths=np.array([4]), target_fingerprint=np.array("abc"))
    with pytest.raises(CorpusFormatError, match="not a corpus"):
        read_corpus(tmp_path, "abc")


def test_first_tokens_keeps_whole_answers_within_the_cap():
    answers = [np.arange(3), np.arange(4), np.arange(2)]
    assert [len(a) for a in first_tokens(answers, 7)] == [3, 4]
    assert first_tokens(answers, 2) == []


def _datagen_folder(path, responses):
    samples = [Sample(np.array([100 + i, 101]), np.array(r), 0, i) for i, r in enumerate(responses)]
    write_shard(path / "shard_00000.npz", samples, [True] * len(samples))
    write_manifest(path, {"target": "tiny", "shards": ["shard_00000.npz"]})


def test_d3d_corpus_writes_the_answers_into_a_drafter_folder(tmp_path, tiny_pair_dir, tiny_models):
    _datagen_folder(tmp_path, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text((Path(tiny_pair_dir[1]) / "config.json").read_text())
    args = ["corpus", "--data", str(tmp_path), "--drafter", str(folder), "--max-tokens", "5"]
    assert d3d(args) == 0
    got = read_corpus(folder, read_config(folder).target_fingerprint)
    assert [a.tolist() for a in got] == [[5, 6, 7], [8, 9]]  # answers only, within the cap


def test_d3d_corpus_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(SystemExit, match="no datagen shards"):
        d3d(["corpus", "--data", str(tmp_path), "--drafter", str(tmp_path)])
    _datagen_folder(tmp_path, [[5, 6]])
    with pytest.raises(SystemExit, match="not a drafter folder"):
        d3d(["corpus", "--data", str(tmp_path), "--drafter", str(tmp_path)])


def test_a_drafter_loads_its_corpus_and_refuses_another_targets(tmp_path, tiny_pair_dir,
                                                                tiny_models):
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(tiny_pair_dir[1], folder)
    target = tiny_models[1]
    assert D3DDrafter.from_pretrained(folder, target).corpus is None
    write_corpus(folder, [np.array([3, 4, 5])], read_config(folder).target_fingerprint)
    assert [a.tolist() for a in D3DDrafter.from_pretrained(folder, target).corpus] == [[3, 4, 5]]
    write_corpus(folder, [np.array([3, 4, 5])], "another")
    with pytest.raises(CorpusFormatError, match="another target's"):
        D3DDrafter.from_pretrained(folder, target)


# ---- in the engine ------------------------------------------------------------------------------
def _with_corpus(monkeypatch, models, answers):
    monkeypatch.setattr(models[2], "corpus", [np.array(a) for a in answers])


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_a_greedy_request_copies_the_targets_answer_from_the_corpus(tiny_models, monkeypatch, mode):
    """The corpus holds the target's answer to this prompt: the first cycle copies 8 tokens
    of it with no drafter pass, and all are accepted. Outputs stay the target's."""
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    _with_corpus(monkeypatch, tiny_models, [WANDERS + ref])
    eng = make_engine(tiny_models, mode, block=4, batch=1, shared_lookup_tokens=0)
    out, first = first_cycle(eng, WANDERS, SamplingParams(max_new_tokens=30))
    assert out.token_ids == ref
    assert first.copied and first.num_drafts == first.num_accepted == 8
    assert eng.corpus.found >= 1


def test_a_wrong_corpus_costs_guesses_not_outputs(tiny_models, monkeypatch):
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    vocab = tiny_models[1].arch.vocab_size
    wrong = [(t + 1) % vocab for t in ref[1:]]
    _with_corpus(monkeypatch, tiny_models, [WANDERS + ref[:1] + wrong])
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    out, first = first_cycle(eng, WANDERS, SamplingParams(max_new_tokens=30))
    assert out.token_ids == ref
    assert first.copied and first.num_accepted < first.num_drafts


@pytest.mark.parametrize("guesses", [0, 16])
def test_the_corpus_guesses_beside_a_wrong_copy_are_verified_too(tiny_models, monkeypatch,
                                                                 guesses):
    """The corpus went on wrongly twice and as the target does once after this prompt: the
    copy is the wrong run, and the target's answer is its sibling in the tree of guesses.
    With guesses the first cycle of copies accepts 8 tokens of it; without, none."""
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    vocab = tiny_models[1].arch.vocab_size
    wrong = [(t + 1) % vocab for t in ref[1:]]
    _with_corpus(monkeypatch, tiny_models, [WANDERS + ref[:1] + wrong] * 2 + [WANDERS + ref])
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0,
                      copy_guesses=guesses)
    out, first = first_cycle(eng, WANDERS, SamplingParams(max_new_tokens=30))
    assert out.token_ids == ref
    assert first.copied and first.num_accepted == (8 if guesses else 0)
    assert first.tree_nodes == (16 if guesses else 0)


def test_off_or_absent_means_no_copy_from_the_corpus(tiny_models, monkeypatch):
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    params = SamplingParams(max_new_tokens=30)
    plain = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    assert plain.corpus is None  # the tiny drafter has none
    _with_corpus(monkeypatch, tiny_models, [WANDERS + ref])
    off = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0,
                      corpus_tokens=0)
    assert off.corpus is None
    out, first = first_cycle(off, WANDERS, params)
    assert out.token_ids == ref and not first.copied
    capped = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, corpus_tokens=len(ref))
    assert capped.corpus is not None and len(capped.corpus) == 0  # the answer does not fit


def test_a_seeded_sampled_request_does_not_copy_from_the_corpus(tiny_models, monkeypatch):
    """Sampled rows keep to their own text, as with earlier requests' text: they draw what
    an engine without a corpus draws."""
    sampled = SamplingParams(temperature=0.8, seed=3, max_new_tokens=30)
    ref = reference_greedy(tiny_models[0], WANDERS, 30)
    off = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    want = generate(off, [WANDERS], sampled)[0].token_ids
    _with_corpus(monkeypatch, tiny_models, [WANDERS + ref, WANDERS + want])
    eng = make_engine(tiny_models, Mode.SYNC, block=4, batch=1, shared_lookup_tokens=0)
    out, first = first_cycle(eng, WANDERS, sampled)
    assert not first.copied and out.token_ids == want
