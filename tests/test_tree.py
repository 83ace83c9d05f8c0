"""Token trees (speculative/tree.py) and the target's tree verify pass (models/target.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import layout_models, reference_greedy
from engine_helpers import OracleDrafter, chain_tree, make_engine

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.target import TargetRunner
from sglang_d3d.speculative.cycle import Plan
from sglang_d3d.speculative.draft_state import DraftState
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.tree import (
    DraftTree,
    ancestor_mask,
    build_tree,
    chain_accepted,
    greedy_tree_accept,
    pad,
    path_tokens,
    sure_chain,
    sure_trie,
)
from sglang_d3d.speculative.tree_sampling import sampled_tree_accept
from sglang_d3d.testing import tiny_hf_model


def _q(rows: list[dict[int, float]], vocab: int = 10) -> torch.Tensor:
    q = torch.full((len(rows), vocab), 1e-6)
    for d, row in enumerate(rows):
        for t, p in row.items():
            q[d, t] = p
    return q / q.sum(-1, keepdim=True)


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, tree.size + 1):
        path, node = [], i
        while node:
            path.append(tree.tokens[node - 1])
            node = tree.parents[node - 1]
        out.add(tuple(reversed(path)))
    return out


def test_build_tree_keeps_the_likeliest_paths():
    q = _q([{5: 0.9, 6: 0.1}, {7: 0.6, 8: 0.4}, {1: 0.5, 2: 0.5}])
    tree = build_tree(q, nodes=4)
    # scores: (5) .9, (5,7) .54, (5,8) .36, (5,7,1) = (5,7,2) .27, (6) .1
    assert _paths(tree) == {(5,), (5, 7), (5, 8), (5, 7, 1)} or \
        _paths(tree) == {(5,), (5, 7), (5, 8), (5, 7, 2)}
    assert tree.depths[tree.tokens.index(5)] == 1 and tree.depth == 3
    for i, p in enumerate(tree.parents, start=1):  # parents come first
        assert p < i


def test_build_tree_against_brute_force():
    """The best-first tree holds exactly the `nodes` best-scoring paths."""
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(3, 5) * 2, -1)
    scores = {}
    for d in range(1, 4):
        for path in itertools.product(range(5), repeat=d):
            scores[path] = float(torch.prod(torch.stack([q[j, t] for j, t in enumerate(path)])))
    best = sorted(scores, key=scores.get, reverse=True)
    for nodes in (1, 3, 7, 12):
        assert _paths(build_tree(q, nodes, width=5)) == set(best[:nodes])


def test_build_tree_with_one_depth_and_few_candidates():
    q = _q([{3: 0.7, 4: 0.3}])
    tree = build_tree(q, nodes=5, width=2)
    assert tree.tokens == (3, 4) and tree.parents == (0, 0) and tree.depths == (1, 1)


def test_ancestor_mask():
    tree = DraftTree(tokens=(5, 7, 8, 1), parents=(0, 1, 1, 2), depths=(1, 2, 2, 3))
    m = ancestor_mask(tree).int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    assert torch.equal(ancestor_mask(chain_tree([4, 4, 4])), torch.tril(torch.ones(4, 4)).bool())


def test_greedy_tree_accept_follows_the_target():
    tree = DraftTree(tokens=(5, 7, 8, 1), parents=(0, 1, 1, 2), depths=(1, 2, 2, 3))
    # root -> 5 (node 1) -> 8 (node 3), whose child list is empty: next token from node 3
    path, nxt = greedy_tree_accept(tree, [5, 8, 0, 9, 0])
    assert path == [1, 3] and nxt == 9 and path_tokens(tree, path) == [5, 8]
    path, nxt = greedy_tree_accept(tree, [5, 7, 1, 0, 0])
    assert path == [1, 2, 4] and nxt == 0
    assert greedy_tree_accept(tree, [6, 0, 0, 0, 0]) == ([], 6)


def test_chain_tree_accepts_like_a_chain():
    tree = chain_tree([3, 4, 5])
    assert greedy_tree_accept(tree, [3, 4, 9, 0]) == ([1, 2], 9)
    assert greedy_tree_accept(tree, [3, 4, 5, 6]) == ([1, 2, 3], 6)


@pytest.mark.parametrize("sure", [False, True])
def test_padding_repeats_are_never_accepted(sure):
    """pad() repeats the last node as its later sibling: greedy and sampled acceptance take
    the original or nothing, never the repeat."""
    base = DraftTree((5, 7, 8), (0, 1, 1), (1, 2, 2), (False, False, sure) if sure else ())
    tree = pad(base, 6)
    assert tree.size == 6 and tree.parents[3:] == (1, 1, 1) and tree.tokens[3:] == (8, 8, 8)
    assert pad(base, 2) == base
    assert greedy_tree_accept(tree, [5, 8, 0, 4, 0, 0, 0]) == ([1, 3], 4)
    q = _q([{5: 0.6, 6: 0.4}, {7: 0.5, 8: 0.5}])
    p = torch.softmax(torch.randn(7, 10, generator=torch.Generator().manual_seed(0)), -1)
    p[0] = 0.0
    p[0, 5] = 1.0  # node 1 is always accepted; then 7, 8 or the next token
    for seed in range(300):
        path, _ = sampled_tree_accept(tree, q, p, torch.Generator().manual_seed(seed))
        assert path in ([1], [1, 2], [1, 3])
        # padding draws nothing: the same verdict and the same stream after it as unpadded
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert sampled_tree_accept(tree, q, p, g1) == sampled_tree_accept(base, q, p[:4], g2)
        assert torch.rand(1, generator=g1) == torch.rand(1, generator=g2)


@pytest.fixture(scope="module")
def runner() -> TargetRunner:
    torch.manual_seed(0)
    return TargetRunner(Decoder.from_hf(tiny_hf_model()), num_slots=2, max_len=64)


def _tree_inputs(tree: DraftTree, root: int):
    tokens = torch.tensor([[root, *tree.tokens]])
    depths = torch.tensor([[0, *tree.depths]])
    return tokens, (depths, ancestor_mask(tree).unsqueeze(0))


def test_tree_verify_scores_each_path_as_its_own_chain(runner):
    """Every node's logits equal those of a chain verify of its own path, and keeping a path
    leaves the cache as a chain verify of it would have."""
    _check_tree_pass(runner)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_verify_on_cuda():
    """The same on the GPU path (masks and positions built on the host, moved once)."""
    torch.manual_seed(0)
    _check_tree_pass(TargetRunner(Decoder.from_hf(tiny_hf_model().cuda()), num_slots=2, max_len=64))


def _check_tree_pass(runner: TargetRunner) -> None:
    prompt = [4, 9, 17, 33, 8, 21]
    tree = DraftTree(tokens=(5, 7, 8, 1, 2), parents=(0, 1, 1, 3, 0), depths=(1, 2, 2, 3, 1))
    runner.prefill(0, prompt[:-1])
    tokens, trees = _tree_inputs(tree, prompt[-1])
    got = runner.forward_block([0], tokens, trees)[0]  # [6, V]
    for node, path in [(3, [1, 3]), (4, [1, 3, 4]), (5, [5]), (2, [1, 2])]:
        runner.prefill(1, prompt[:-1])
        chain = torch.tensor([[prompt[-1], *path_tokens(tree, path)]])
        want = runner.forward_block([1], chain)[0]
        torch.testing.assert_close(got[node], want[-1], rtol=1e-4, atol=1e-4)
    # keep the path root -> 5 -> 8 -> 1 (nodes 1, 3, 4), then decode one more token
    runner.keep_path(0, [1, 3, 4])
    runner.advance(0, 4)
    runner.prefill(1, prompt[:-1])
    runner.forward_block([1], torch.tensor([[prompt[-1], 5, 8, 1]]))
    runner.advance(1, 4)
    a = runner.forward_block([0], torch.tensor([[11]]))
    b = runner.forward_block([1], torch.tensor([[11]]))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- the engine ----------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15], [70]]


def _spy_trees(eng):
    """Record every verify pass: (width, was it a tree)."""
    passes, real = [], eng._verify

    def spy(rows, tokens, proposals, trees=None, *, threads):
        passes.append((tokens.shape[1], trees is not None))
        return real(rows, tokens, proposals, trees, threads=threads)

    eng._verify = spy
    return passes


@pytest.mark.parametrize("layout,block,nodes", [("tiny", 4, 6), ("tiny", 5, 3), ("production", 8, 7),
                                                ("production", 4, 12)])
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
@pytest.mark.parametrize("lookup", [0, 5])
def test_tree_verification_keeps_greedy_output_identical(request, layout, block, nodes, mode,
                                                         lookup):
    """Trees in every cycle without pre-drafting (sync: all of them), batches of several rows,
    and the drafter and target caches follow the accepted paths: output = the target's. With
    `lookup`, trees also carry guesses copied from the text (random tiny models repeat
    themselves, so copies are found), deeper than the block."""
    models = layout_models(request, layout)
    # (cycles of copies verify chains here: their trees of guesses are test_copy_cycles')
    eng = make_engine(models, mode, block=block, tree_nodes=nodes, lookup_tokens=lookup,
                      copy_guesses=0)
    passes = _spy_trees(eng)
    stats = []
    eng.cycle_listeners.append(lambda rid, c: stats.append(c))
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, o in zip(PROMPTS, out):
        assert o.error is None
        assert o.token_ids == reference_greedy(models[0], prompt, 24)
    trees = [w for w, tree in passes if tree]
    if mode is Mode.SYNC:  # every speculative pass a tree, of the drafter's width or grown
        # (4 rows: the verify token budget leaves room for fewer copies beside a wide tree)
        assert trees and set(trees) <= {nodes + 1 + k for k in range(lookup + 1)}
    assert all(0 <= c.num_accepted <= c.num_drafts <= max(block - 1, lookup + 1) for c in stats)
    if lookup and mode is Mode.SYNC:
        assert any(w > nodes + 1 for w in trees)  # copies found (random tiny models repeat)
        if lookup + 1 > block - 1:
            assert max(c.num_drafts for c in stats) > block - 1  # a copy went past the block


def test_trees_accept_paths_a_chain_would_have_missed(tiny_models):
    """The same requests with trees accept more drafts per cycle than with chains, at equal
    output: the oracle drafter ranks the target's token second or third at some positions,
    which a chain rejects and a tree holds."""
    def run(nodes):
        eng = make_engine(tiny_models, Mode.SYNC, block=4, tree_nodes=nodes, lookup_tokens=0)
        OracleDrafter(eng, tiny_models[0])
        stats = []
        eng.cycle_listeners.append(lambda rid, c: stats.append(c.num_accepted))
        out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=32))
        return [o.token_ids for o in out], sum(stats) / len(stats)

    chain_out, chain_rate = run(0)
    tree_out, tree_rate = run(9)
    assert tree_out == chain_out
    assert tree_rate > chain_rate


def test_sampled_rows_verify_trees(request):
    """Sampled rows, alone and batched with greedy ones, verify trees (tree_sampling.py): every
    speculative pass of a sync engine is a tree, requests complete, and the greedy rows still
    equal the target's output."""
    models = layout_models(request, "production")
    eng = make_engine(models, Mode.SYNC, block=8, tree_nodes=7, lookup_tokens=0)
    passes = _spy_trees(eng)
    sampled = SamplingParams(temperature=0.8, seed=1, max_new_tokens=16)
    greedy = SamplingParams(max_new_tokens=16)
    out = generate(eng, PROMPTS, [sampled, greedy, sampled, greedy])
    assert all(o.error is None and len(o.token_ids) == 16 for o in out)
    assert passes and all(tree for _, tree in passes)
    for i in (1, 3):
        assert out[i].token_ids == reference_greedy(models[0], PROMPTS[i], 16)


def test_a_row_with_sure_drafts_joins_the_trees_as_a_sure_chain():
    """A placeholder (or a run copied in place of drafting) has no proposals: it joins its
    batch's trees as a chain of sure nodes padded to their size, and the drafted rows keep
    their trees (it used to turn the whole batch into chains)."""
    q = torch.softmax(4 * torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), -1)
    drafted = DraftState(0, SamplingParams(), None, [1, 2, 3], [], q.argmax(-1).tolist(), q)
    sure = DraftState(1, SamplingParams(temperature=0.8), None, [4, 5], [], [9, 9, 9], None)
    trees = Drafting.__new__(Drafting).trees([drafted, sure], nodes=5)
    assert [t.size for t in trees] == [5, 5]
    assert trees[0] == build_tree(q, 5)
    assert trees[1] == pad(sure_chain([9, 9, 9]), 5) and trees[1].padded == 2


def test_a_trie_of_copies_merges_common_prefixes_and_keeps_within_its_size():
    trie = sure_trie([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]], max_nodes=8)
    assert trie.tokens == (1, 2, 3, 4, 5)
    assert trie.parents == (0, 1, 2, 2, 0) and trie.depths == (1, 2, 3, 3, 1)
    assert all(trie.is_sure(i) for i in range(1, 6))
    assert greedy_tree_accept(trie, [1, 2, 4, 0, 7, 0]) == ([1, 2, 4], 7)  # the second path
    cut = sure_trie([[1, 2, 3], [1, 6, 7]], max_nodes=4)
    assert cut.tokens == (1, 2, 3, 6) and cut.parents == (0, 1, 2, 1)  # the last path cut short
    assert sure_trie([[4, 5]], 8) == sure_chain([4, 5])


def test_tree_nodes_is_checked():
    with pytest.raises(ValueError, match="tree_nodes"):
        EngineConfig(tree_nodes=-1)


def test_chain_accepted():
    # chain 5 7 1; the tree accepted 5 8 (a second guess), then the target said 9
    assert chain_accepted([5, 7, 1], [5, 8], 9) == 1
    assert chain_accepted([5, 7, 1], [5, 7, 1], 4) == 3  # the chain's own path, all accepted
    assert chain_accepted([5, 7, 1], [5, 7], 1) == 3  # the token after the path is the chain's
    assert chain_accepted([5, 7, 1], [], 6) == 0


def test_the_controller_counts_what_the_chain_would_have_accepted(tiny_models):
    """Acceptance rates stay the chain's whichever way a block was verified, so the rates
    of pre-drafted (chain) plans are not inflated by tree cycles."""
    eng = make_engine(tiny_models, Mode.SYNC, block=4, adaptive=True)
    tree = SimpleNamespace(stats=SimpleNamespace(num_drafts=2, num_accepted=2), chain=(3, 1))
    chain = SimpleNamespace(stats=SimpleNamespace(num_drafts=3, num_accepted=2), chain=None)
    assert eng._tested(Plan(4), [tree, chain]) == [(3, 1), (3, 2)]


def test_tree_cycles_report_depth_and_the_chain(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, block=4, tree_nodes=6, adaptive=True, lookup_tokens=0)
    OracleDrafter(eng, tiny_models[0])
    seen = []
    real = eng._tested
    eng._tested = lambda plan, outcomes: seen.extend(outcomes) or real(plan, outcomes)
    generate(eng, PROMPTS, SamplingParams(max_new_tokens=16))
    trees = [o for o in seen if o.chain is not None]
    assert trees and all(o.chain[0] == 3 and 0 <= o.chain[1] <= 3 for o in trees)
    assert all(o.stats.num_accepted <= o.stats.num_drafts <= 3 for o in trees)
    # the chain agrees with the target at most one token past the tree's path
    assert all(o.chain[1] <= o.stats.num_accepted + 1 for o in trees)
    # the oracle ranks the truth second at some positions: there the tree goes further
    assert any(o.stats.num_accepted > o.chain[1] for o in trees)


def test_the_controller_learns_what_trees_yield(tiny_models):
    """Trees that hold second guesses (the oracle ranks the truth second at some positions)
    raise the controller's estimate of the plan they verified, greedy and sampled alike."""
    for params in (SamplingParams(max_new_tokens=24),
                   SamplingParams(temperature=0.5, seed=3, max_new_tokens=24)):
        eng = make_engine(tiny_models, Mode.SYNC, block=4, tree_nodes=6, adaptive=True, lookup_tokens=0)
        OracleDrafter(eng, tiny_models[0])
        eng.controller.choose = lambda *a, **k: Plan(4)  # speculate in every cycle
        generate(eng, PROMPTS, params)
        assert list(eng.controller.tree_yield) == [Plan(4)]
        assert eng.controller.tree_factor(Plan(4)) > 1.0


def test_a_failing_tree_row_fails_alone(tiny_models):
    """A row whose tree verification raises ends with an error; the others stay exact."""
    eng = make_engine(tiny_models, Mode.SYNC, block=4, tree_nodes=5, lookup_tokens=0)
    real, bad = eng.target.keep_path, {}

    def keep_path(slot, path):
        if slot == bad.setdefault("slot", slot):
            raise RuntimeError("boom")
        return real(slot, path)

    eng.target.keep_path = keep_path
    out = generate(eng, PROMPTS, SamplingParams(max_new_tokens=12))
    failed = [o for o in out if o.error is not None]
    assert len(failed) == 1 and "boom" in failed[0].error
    for prompt, o in zip(PROMPTS, out):
        if o.error is None:
            assert o.token_ids == reference_greedy(tiny_models[0], prompt, 12)
