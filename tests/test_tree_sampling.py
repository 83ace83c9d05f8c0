"""Sampled token trees (speculative/tree_sampling.py): draws without replacement, and recursive
rejection sampling down a tree that keeps the target's distribution exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import chain_tree

from sglang_d3d.speculative.tree import DraftTree, build_tree, graft, pad, sure_chain
from sglang_d3d.speculative.tree_sampling import (
    draw_without_replacement,
    sample_tree,
    sampled_tree_accept,
    sibling_ranks,
)
from sglang_d3d.speculative.verify import rejection_accept


def _chi2_ok(counts: dict, exact: dict, n: int) -> tuple[float, int]:
    """Chi-square of `counts` (n draws) against `exact` probabilities, cells under 5 expected
    pooled; asserts the statistic is under dof + 5 sd (a one-in-millions false alarm)."""
    big = [k for k in exact if exact[k] * n >= 5]
    small = [k for k in exact if k not in big]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)]
    exp = [exact[k] * n for k in big] + [n * sum(exact[k] for k in small)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(big)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
    assert set(counts) <= set(exact)
    return chi2, dof


def test_sibling_ranks():
    # root: children 1, 2, 5; node 1: children 3, 4
    tree = DraftTree((7, 8, 9, 6, 5), (0, 0, 1, 1, 0), (1, 1, 2, 2, 1))
    assert sibling_ranks(tree) == [0, 1, 0, 1, 2]


def test_draws_without_replacement_follow_sequential_drawing():
    """After the given first draw, the second is q without it, renormalised; the third, q
    without both."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    n = 20000
    pairs: dict = {}
    for _ in range(n):
        d = draw_without_replacement(q, 0, 3, g)
        assert d[0] == 0 and len(set(d)) == 3
        pairs[tuple(d[1:])] = pairs.get(tuple(d[1:]), 0) + 1
    exact = {}
    for a, b in itertools.permutations([1, 2, 3], 2):
        exact[(a, b)] = float(q[a] / 0.5 * q[b] / (0.5 - q[a]))
    _chi2_ok(pairs, exact, n)


def test_draws_past_the_support_are_distinct_and_massless():
    q = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    d = draw_without_replacement(q, 3, 4, torch.Generator().manual_seed(1))
    assert d[:2] == [3, 1] and len(set(d)) == 4 and all(q[t] == 0 for t in d[2:])
    assert draw_without_replacement(q, 3, 1, None) == [3]


def test_sample_tree_keeps_the_shape_and_the_chain():
    q = torch.softmax(torch.randn(3, 12, generator=torch.Generator().manual_seed(2)) * 2, -1)
    shape = build_tree(q, 7)
    chain = [int(torch.multinomial(q[d], 1)) for d in range(3)]
    tree = sample_tree(shape, chain, q, torch.Generator().manual_seed(3))
    assert (tree.parents, tree.depths) == (shape.parents, shape.depths)
    ranks = sibling_ranks(tree)
    for i, (d, r) in enumerate(zip(tree.depths, ranks)):
        if r == 0:
            assert tree.tokens[i] == chain[d - 1]  # slot 0 of every depth: the chain's draft
    kids: dict = {}
    for p, t in zip(tree.parents, tree.tokens):
        kids.setdefault(p, []).append(t)
    assert all(len(set(ts)) == len(ts) for ts in kids.values())  # siblings are distinct


class _Target:
    """A made-up target over a small vocabulary: its next-token distribution after any token
    path is a fixed random law of that path."""

    def __init__(self, vocab: int, seed: int, sharp: float = 1.5) -> None:
        self.vocab, self.seed, self.sharp = vocab, seed, sharp
        self._cache: dict = {}

    def p(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self._cache:
            g = torch.Generator().manual_seed(hash((self.seed, path)) % (2**31))
            self._cache[path] = torch.softmax(torch.randn(self.vocab, generator=g) * self.sharp, -1)
        return self._cache[path]

    def node_probs(self, tree: DraftTree) -> torch.Tensor:
        """[M+1, V] the law after each node's path (node 0: the root, the empty path)."""
        paths = [()]
        for p, t in zip(tree.parents, tree.tokens):
            paths.append(paths[p] + (t,))
        return torch.stack([self.p(path) for path in paths])


def _one_cycle(target: _Target, q: torch.Tensor, nodes: int, length: int,
               g: torch.Generator, copy=None) -> tuple[tuple[int, ...], int]:
    """One sampled tree cycle, then plain sampling from the target up to `length` tokens (as
    the next cycles would, exactly). `copy`: first draft -> guesses grafted under it, proposed
    surely (as the engine's copies from the text). -> (the first `length` tokens, drafts
    accepted)."""
    chain = [int(torch.multinomial(q[d], 1, generator=g)) for d in range(q.shape[0])]
    tree = sample_tree(build_tree(q, nodes), chain, q, g)
    if copy is not None:
        tree = graft(tree, copy(chain[0]), nodes, sure=True)
    path, token = sampled_tree_accept(tree, q, target.node_probs(tree), g)
    out = [tree.tokens[i - 1] for i in path] + [token]
    while len(out) < length:
        out.append(int(torch.multinomial(target.p(tuple(out)), 1, generator=g)))
    return tuple(out[:length]), len(path)


def _exact(target: _Target, length: int) -> dict:
    out = {}
    for seq in itertools.product(range(target.vocab), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(target.p(seq[:i])[seq[i]])
        out[seq] = prob
    return out


@pytest.mark.parametrize("vocab,depth,nodes", [(5, 2, 5), (4, 3, 7)])
def test_sampled_trees_follow_the_target(vocab, depth, nodes):
    """The tokens a sampled tree cycle emits (then the target's own sampling) have the
    target's joint law, over every path the tree can take: chi-square over all sequences."""
    target = _Target(vocab, seed=depth)
    # a proposal unlike the target (a different random law per depth), so rejections and
    # second and third children are all exercised
    q = torch.softmax(torch.randn(depth, vocab, generator=torch.Generator().manual_seed(9)), -1)
    g = torch.Generator().manual_seed(4)
    n = 12000
    counts: dict = {}
    for _ in range(n):
        seq, _ = _one_cycle(target, q, nodes, depth + 1, g)
        counts[seq] = counts.get(seq, 0) + 1
    _chi2_ok(counts, _exact(target, depth + 1), n)


@pytest.mark.parametrize("vocab,depth,nodes", [(4, 2, 6), (3, 2, 7)])
def test_sampled_trees_with_copies_follow_the_target(vocab, depth, nodes):
    """Copied guesses grafted under the first draft as nodes proposed surely, past the
    drafter's depth and beside its draws (the same token twice under one parent included):
    the emitted tokens still have the target's joint law over every path."""
    target = _Target(vocab, seed=depth + vocab)
    q = torch.softmax(torch.randn(depth, vocab, generator=torch.Generator().manual_seed(11)), -1)
    g = torch.Generator().manual_seed(12)

    def copy(first: int) -> list[int]:  # a function of the path, as a lookup is: here
        path = (first,)  # the target's likeliest tokens, so that copies are taken often
        for _ in range(3):
            path += (int(target.p(path).argmax()),)
        return list(path[1:])

    n, length = 12000, depth + 3
    counts: dict = {}
    past = 0  # cycles that accepted more drafts than the drafter drafted: through a copy
    for _ in range(n):
        seq, a = _one_cycle(target, q, nodes, length, g, copy)
        counts[seq] = counts.get(seq, 0) + 1
        past += a > depth
    _chi2_ok(counts, _exact(target, length), n)
    assert past > n // 50


def test_a_sure_child_is_taken_with_the_targets_probability():
    """A child proposed with probability one is accepted with probability p(c); after its
    rejection the next token never is c."""
    tree = DraftTree((2,), (0,), (1,), (True,))
    q = torch.zeros(0, 4)  # no drafter proposal involved
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    n, taken = 4000, 0
    for seed in range(n):
        path, token = sampled_tree_accept(tree, q, p, torch.Generator().manual_seed(seed))
        taken += path == [1]
        assert path == [1] or token != 2
    assert abs(taken / n - 0.3) < 0.03
    sure = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25] * 4])
    assert sampled_tree_accept(tree, q, sure, torch.Generator().manual_seed(0))[0] == [1]


def test_a_sure_chain_needs_no_proposals():
    """A run copied from the text, or a placeholder, verified as a chain of sure nodes
    (tree.sure_chain): no drafter proposal is read, so none is needed, and padding changes
    nothing; a tree with drawn nodes refuses to go without its proposals."""
    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(6, 5, generator=gen), -1)  # [M+1, V], padded rows included
    q = torch.softmax(torch.randn(3, 5, generator=gen), -1)
    tree = sure_chain([1, 2, 3])
    assert (tree.parents, tree.depths, tree.sure) == ((0, 1, 2), (1, 2, 3), (True,) * 3)
    def walk(t, proposals, probs, seed):
        return sampled_tree_accept(t, proposals, probs, torch.Generator().manual_seed(seed))

    for seed in range(100):
        got = walk(tree, None, p[:4], seed)
        assert got == walk(tree, q, p[:4], seed) == walk(pad(tree, 5), None, p, seed)
    with pytest.raises(ValueError, match="proposals"):
        sampled_tree_accept(DraftTree((1,), (0,), (1,)), None, p[:2], torch.Generator())


def test_sampled_trees_accept_more_than_chains():
    """Same target and proposal: a tree of 5 accepts more drafts per cycle than the chain of 2
    (the chain's own draft is tried first, then its siblings)."""
    target, q = _Target(6, seed=5), torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(6)), -1)
    g = torch.Generator().manual_seed(7)
    n = 3000
    chain = sum(_one_cycle(target, q, 2, 3, g)[1] for _ in range(n)) / n
    tree = sum(_one_cycle(target, q, 5, 3, g)[1] for _ in range(n)) / n
    assert tree > chain + 0.1, (tree, chain)


def test_a_chain_tree_is_the_chains_rejection_sampling():
    """One child per node: the same verdict as chain rejection sampling, uniform for uniform."""
    gen = torch.Generator().manual_seed(8)
    for trial in range(200):
        v, d = 7, 3
        q = torch.softmax(torch.randn(d, v, generator=gen), -1)
        p = torch.softmax(torch.randn(d + 1, v, generator=gen), -1)
        draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(d)]
        tree = chain_tree(draft)
        path, token = sampled_tree_accept(tree, q, p, torch.Generator().manual_seed(trial))
        n, token_c = rejection_accept(torch.tensor(draft), q, p, torch.Generator().manual_seed(trial))
        assert (len(path), token) == (n, token_c) and path == list(range(1, n + 1))


def test_a_child_outside_the_proposal_is_never_accepted():
    """A slot past q's support holds a token of zero mass (no draw): it is not tried, even
    where the target wants it."""
    q = torch.tensor([[0.0, 1.0, 0.0]])
    p = torch.tensor([[0.0, 0.0, 1.0], [1 / 3] * 3, [1 / 3] * 3])
    tree = DraftTree((1, 2), (0, 0), (1, 1))  # 2 is no draw from q
    for seed in range(20):
        path, token = sampled_tree_accept(tree, q, p, torch.Generator().manual_seed(seed))
        assert path == [] and token == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampled_tree_verify_with_the_drafter_on_another_device():
    """Target distributions on the GPU, the drafter's on the CPU (a drafter on its own device):
    a chain tree gives chain rejection sampling's verdict, drawn from the same request stream."""
    from sglang_d3d.speculative.sampling import RequestRandom

    gen = torch.Generator().manual_seed(10)
    for trial in range(50):
        q = torch.softmax(torch.randn(3, 7, generator=gen), -1)  # on the CPU
        p = torch.softmax(torch.randn(4, 7, generator=gen), -1).cuda()
        draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(3)]
        tree = chain_tree(draft)
        path, token = sampled_tree_accept(tree, q, p, RequestRandom(trial))
        n, token_c = rejection_accept(torch.tensor(draft).cuda(), q.cuda(), p, RequestRandom(trial))
        assert (len(path), token) == (n, token_c)
