"""Prompt-lookup guesses (speculative/lookup.py) and their graft into a token tree (tree.py)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_d3d.speculative.lookup import NgramIndex, lookup_continuation
from sglang_d3d.speculative.tree import DraftTree, build_tree, graft, greedy_tree_accept


def naive_lookup(tokens, length, max_ngram=4, min_ngram=2):
    """The definition, spelt out: longest suffix first, its latest earlier occurrence, the copy
    running on into its own guesses past the end."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                ext = list(tokens)
                for j in range(length):
                    ext.append(ext[s + n + j])
                return ext[len(tokens):]
    return []


def test_copies_what_followed_the_last_occurrence():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 0, 5, 6]
    assert lookup_continuation(text, 3) == [7, 3, 4]  # latest "5 6" is at 7, not 0


def test_prefers_the_longest_suffix():
    # "6 7" last occurred before 1, but "5 6 7" only before 9
    text = [5, 6, 7, 9, 9, 6, 7, 1, 1, 5, 6, 7]
    assert lookup_continuation(text, 2) == [9, 9]
    assert lookup_continuation(text, 2, max_ngram=2) == [1, 1]


def test_a_loop_repeats_its_period():
    text = [1, 2, 3, 1, 2, 3, 1, 2]
    assert lookup_continuation(text, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert lookup_continuation([4, 4, 4], 3) == [4, 4, 4]


def test_nothing_to_copy():
    assert lookup_continuation([1, 2, 3, 4], 4) == []
    assert lookup_continuation([1, 2, 3, 1], 4) == []  # a 1-token match is not used
    assert lookup_continuation([1, 2, 3, 1], 4, min_ngram=1) == [2, 3, 1, 2]
    assert lookup_continuation([1, 2, 1, 2], 0) == []
    assert lookup_continuation([], 3) == [] and lookup_continuation([7], 3) == []


def test_matches_the_definition_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        length = rng.randrange(0, 9)
        assert lookup_continuation(text, length) == naive_lookup(text, length), text


def check_tree(tree: DraftTree) -> None:
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths), start=1):
        assert 0 <= p < i  # parents before children
        assert d == (tree.depths[p - 1] + 1 if p else 1)
    # no guess twice under one parent, but a copied one beside the same draw (sampled rows)
    siblings = list(zip(tree.parents, tree.tokens, tree.sure or [False] * tree.size))
    assert len(set(siblings)) == len(siblings)


@pytest.fixture
def q():
    torch.manual_seed(0)
    return torch.softmax(3 * torch.randn(3, 12), -1)  # [D, V]


def test_graft_puts_the_copy_under_the_first_draft(q):
    base = build_tree(q, 9)
    tree = graft(base, [100, 101, 102], 9)
    check_tree(tree)
    assert tree.size == 9
    assert tree.tokens[:4] == (base.tokens[0], 100, 101, 102)
    assert tree.parents[:4] == (0, 1, 2, 3) and tree.depths[:4] == (1, 2, 3, 4)
    # the rest are the drafter's likeliest nodes, in order
    rest = [(t, d) for t, d in zip(tree.tokens[4:], tree.depths[4:])]
    assert rest == [(t, d) for t, d in zip(base.tokens[1:6], base.depths[1:6])]


def test_graft_merges_guesses_the_drafter_made_too(q):
    base = build_tree(q, 6)
    top2 = int(q[1].argmax())  # the drafter's best second draft, already under node 1
    tree = graft(base, [top2, 100], 6)
    check_tree(tree)
    assert tree.size == 6
    assert [t for t, p in zip(tree.tokens, tree.parents) if p == 1].count(top2) == 1
    assert set(zip(base.tokens[:4], base.depths[:4])) <= set(zip(tree.tokens, tree.depths))


def test_a_sampled_graft_marks_the_copy_and_merges_nothing(q):
    """sure=True (a sampled row): the copy's nodes are proposed surely and stand beside the
    drafter's draws, even a draw of the same token under the same parent."""
    base = build_tree(q, 6)
    top2 = int(q[1].argmax())
    tree = graft(base, [top2, 100], 6, sure=True)
    check_tree(tree)
    assert tree.size == 6
    assert tree.sure == (False, True, True, False, False, False)
    assert [t for t, p in zip(tree.tokens, tree.parents) if p == 1].count(top2) == 2
    assert tree.tokens[3:] == base.tokens[1:4]  # then the drafter's nodes, in order
    assert not any(graft(base, [top2, 100], 6).sure)  # a greedy graft marks nothing


def test_graft_without_a_copy_is_the_drafter_tree(q):
    base = build_tree(q, 7)
    assert graft(base, [], 7) == base
    assert graft(build_tree(q, 5), [1] * 10, 5).size == 5  # never past `nodes`


def test_greedy_acceptance_follows_a_copy(q):
    base = build_tree(q, 6)
    tree = graft(base, [100, 101, 102], 6)
    # the target agrees with the first draft, then with the copy, then stops at 7
    argmax = [tree.tokens[0], 100, 101, 102, 7] + [0] * (tree.size - 4)
    path, token = greedy_tree_accept(tree, argmax)
    assert [tree.tokens[i - 1] for i in path] == [tree.tokens[0], 100, 101, 102]
    assert token == 7


def test_the_index_answers_as_the_scan_while_the_text_grows():
    """NgramIndex.continuation equals lookup_continuation at every length of a growing text,
    whatever min_ngram, grown a token or a run at a time."""
    rng = random.Random(1)
    for _ in range(60):
        index, text = NgramIndex(), []
        min_ngram = rng.randrange(1, 4)
        for _ in range(rng.randrange(1, 30)):
            text.extend(rng.randrange(3) for _ in range(rng.randrange(1, 4)))
            length = rng.randrange(0, 7)
            assert index.continuation(text, length, min_ngram) == \
                lookup_continuation(text, length, min_ngram=min_ngram), (text, length, min_ngram)


def test_the_index_answers_for_the_text_and_one_more_token_as_the_scan():
    """continuation_after(text, x) equals lookup_continuation(text + [x]) on random and
    looping texts (where the n-gram before x is itself the latest match), and leaves the
    index as it was for the text itself."""
    rng = random.Random(2)
    for _ in range(300):
        index = NgramIndex()
        text = [rng.randrange(3) for _ in range(rng.randrange(0, 25))]
        extra, length, min_ngram = rng.randrange(3), rng.randrange(0, 7), rng.randrange(1, 4)
        assert index.continuation_after(text, extra, length, min_ngram) == \
            lookup_continuation([*text, extra], length, min_ngram=min_ngram), (text, extra, length)
        assert index.continuation(text, length, min_ngram) == \
            lookup_continuation(text, length, min_ngram=min_ngram)
    loop = NgramIndex()
    assert loop.continuation_after([7, 7, 7], 7, 3) == [7, 7, 7] == lookup_continuation([7] * 4, 3)


def test_the_index_reads_a_new_or_shorter_text_afresh():
    index = NgramIndex()
    text = [1, 2, 3, 1, 2]
    assert index.continuation(text, 2) == [3, 1]
    assert index.continuation([9, 8, 9], 2, min_ngram=1) == [8, 9]  # another list
    text2 = [5, 6, 7, 5, 6]
    assert index.continuation(text2, 1) == [7]
    del text2[3:]  # the same list, shorter: [5, 6, 7]
    assert index.continuation(text2, 2) == [] == lookup_continuation(text2, 2)
    text2[1:] = [1, 2, 5, 1, 2]  # rewritten in place, the last indexed token changed
    assert index.continuation(text2, 2) == [5, 1] == lookup_continuation(text2, 2)
