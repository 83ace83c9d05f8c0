"""Token trees: verify several guesses per position in one target pass.

The D3D drafter fills a block's mask slots in one pass, each slot conditioned on the accepted
prefix only, so slot j gives a distribution q_j over the token j+1 after the anchor that does
not depend on which token was guessed at the slots before it. A tree of candidates is then
cheap: a node at depth d carries one of q_d's likely tokens, under any parent. The tree keeps
the `nodes` paths the drafter thinks likeliest (product of q along the path) and the target
scores all of them in one pass, each node attending to the accepted prefix and its own
ancestors. Measured with the step-600 drafter (offline, on the target's own answers): on 300
GSM8K blocks of 4, a tree of 5 drafts yields 3.03 tokens a cycle against 2.76 for the chain of
3, and on this CPU a verify pass of 6 tokens costs about what one of 4 does.

Greedy verification of a tree keeps the target's output exactly: from the root (the last
accepted token), follow the child whose token is the target's argmax at its parent; the
target's argmax at the last node followed is the next token. Sampled rows verify a tree of the
same shape filled with draws, by recursive rejection sampling (tree_sampling.py).

Node 0 of a tree is the root; nodes 1..M are candidates, parents before children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [M] candidate tokens (node i + 1)
    parents: tuple[int, ...]  # [M] parent node of node i + 1 (0 = the root)
    depths: tuple[int, ...]  # [M] 1 for the root's children
    # [M] or (): nodes proposed with probability one (copied from the text, not drawn from
    # the drafter's q); only sampled verification tells them apart (tree_sampling.py)
    sure: tuple[bool, ...] = ()
    # trailing nodes that only fill the batch's verify shape (`pad`): never tried, and a
    # sampled row draws no randomness for them, so its draws do not depend on its batch
    padded: int = 0

    @property
    def size(self) -> int:
        return len(self.tokens)

    def is_sure(self, node: int) -> bool:
        return bool(self.sure) and self.sure[node - 1]

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)


def build_tree(
    q: torch.Tensor,  # [D, V] drafter probabilities at depths 1..D
    nodes: int,
    width: int = 4,  # candidates per depth considered
) -> DraftTree:
    """The `nodes` likeliest paths (path score = product of q along it), prefix-closed: a
    node's score never exceeds its parent's, so best-first search adds parents first."""
    top_p, top_t = q.float().topk(min(width, q.shape[-1]), dim=-1)  # [D, W]
    logp, cand = top_p.clamp_min(1e-30).log().tolist(), top_t.tolist()
    d_max = q.shape[0]
    # heap entries: (-path log-prob, depth index, rank, parent node, parent log-prob)
    heap = [(-logp[0][0], 0, 0, 0, 0.0)]
    tokens, parents, depths = [], [], []
    while heap and len(tokens) < nodes:
        neg, d, r, parent, base = heapq.heappop(heap)
        tokens.append(cand[d][r])
        parents.append(parent)
        depths.append(d + 1)
        node = len(tokens)
        if r + 1 < len(cand[d]):  # the next sibling under the same parent
            heapq.heappush(heap, (-(base + logp[d][r + 1]), d, r + 1, parent, base))
        if d + 1 < d_max:  # this node's best child
            heapq.heappush(heap, (neg - logp[d + 1][0], d + 1, 0, node, -neg))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths))


class _Builder:
    """A tree grown node by node, parents before children; a (parent, token) already present
    is found again where merging is asked for."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.marks: list[bool] = []
        self.index: dict[tuple[int, int], int] = {}  # (parent node, token) -> its first node

    def add(self, parent: int, token: int, mark: bool = True, merge: bool = True) -> int:
        if merge and (parent, token) in self.index:
            return self.index[(parent, token)]
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent - 1] + 1 if parent else 1)
        self.marks.append(mark)
        self.index.setdefault((parent, token), len(self.tokens))
        return len(self.tokens)

    def tree(self, sure: bool) -> DraftTree:
        marks = tuple(self.marks) if sure else ()
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.depths), marks)


def graft(tree: DraftTree, chain: list[int], nodes: int, sure: bool = False) -> DraftTree:
    """A tree of at most `nodes` drafts: `chain` under the tree's node 1 (the drafter's first
    draft), then the tree's own nodes in their order until `nodes`. `tree` is best-first
    (`build_tree`), so what is left out is what the drafter thought least likely; the result
    keeps parents before children, and the chain before its siblings.
    Greedy rows (sure=False): a guess already present under the same parent is one node.
    Sampled rows (sure=True): the chain's nodes are marked proposed with probability one and
    never merged with the tree's, whose tokens are draws from q (tree_sampling.py): a node
    cannot be both, and every draw must stay in its sibling slot."""
    if tree.size == 0:
        return tree
    b = _Builder()
    b.add(0, tree.tokens[0], tree.is_sure(1))
    node = 1
    for token in chain[: nodes - 1]:
        node = b.add(node, token, sure, not sure)
    mapped = {0: 0, 1: 1}  # the tree's node -> the result's
    for i, (token, parent) in enumerate(zip(tree.tokens[1:], tree.parents[1:]), start=2):
        merges = not sure and (mapped[parent], token) in b.index
        if len(b.tokens) >= nodes and not merges:
            break
        mapped[i] = b.add(mapped[parent], token, tree.is_sure(i), not sure)
    return b.tree(sure)


def sure_chain(tokens: list[int]) -> DraftTree:
    """A chain of nodes proposed with probability one: a run copied from the text, or a
    placeholder draft, verified in a batch of trees (greedy: as the chain; sampled: each node
    accepted with the target's probability of it, tree_sampling.py)."""
    n = len(tokens)
    return DraftTree(tuple(tokens), tuple(range(n)), tuple(range(1, n + 1)), (True,) * n)


def sure_trie(paths: list[list[int]], max_nodes: int) -> DraftTree:
    """Runs copied from several texts as one tree of sure nodes: the paths' common prefixes
    merged, paths taken in order (the likeliest first) until `max_nodes` nodes, the last one
    cut short where it does not fit. Greedy verification follows whichever path the target
    agrees with; the tree is prefix-closed, parents before children."""
    b = _Builder()
    for path in paths:
        node = 0
        for token in path:
            if (node, token) not in b.index and len(b.tokens) >= max_nodes:
                break
            node = b.add(node, token)
    return b.tree(sure=True)


def pad(tree: DraftTree, size: int) -> DraftTree:
    """The tree with its last node repeated up to `size` nodes, so that rows of unequal trees
    share one verify pass. A repeat is its original's later sibling with the same token: greedy
    acceptance takes the first of equal siblings, and sampled acceptance never tries it
    (`padded`), so repeats are never accepted."""
    extra = size - tree.size
    if extra <= 0 or tree.size == 0:
        return tree
    sure = tree.sure + (tree.sure[-1],) * extra if tree.sure else ()
    return DraftTree(tree.tokens + (tree.tokens[-1],) * extra, tree.parents + (tree.parents[-1],) * extra,
                     tree.depths + (tree.depths[-1],) * extra, sure, tree.padded + extra)


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[M+1, M+1] bool: node i may attend to node j (j is i or an ancestor of i)."""
    m = tree.size + 1
    mask = torch.eye(m, dtype=torch.bool)
    for i, p in enumerate(tree.parents, start=1):
        mask[i] |= mask[p]  # parents come before children, so row p is complete
    return mask


def children(tree: DraftTree) -> dict[int, list[int]]:
    """node -> its children, in the order they were added (parents come before children)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents, start=1):
        out.setdefault(p, []).append(i)
    return out


def greedy_tree_accept(
    tree: DraftTree,
    argmax: list[int],  # [M+1] the target's argmax after each node (node 0: the root)
) -> tuple[list[int], int]:
    """-> (accepted nodes, root excluded, in path order; the target's next token)."""
    by_token = {p: {tree.tokens[c - 1]: c for c in reversed(kids)}  # the first of equal siblings
                for p, kids in children(tree).items()}
    path, node = [], 0
    while (nxt := by_token.get(node, {}).get(argmax[node])) is not None:
        path.append(nxt)
        node = nxt
    return path, argmax[node]


def chain_accepted(chain: list[int], path: list[int], token: int) -> int:
    """Drafts the chain (the drafter's top-1 guesses) would have accepted where the tree
    accepted `path` and the target's next token is `token`: greedy verification accepts the
    chain while it agrees with the target's argmax, which is `path + [token]` from the root.
    Exact unless the tree left out a chain node the target would have accepted past the
    token after its path (the target never scored that far): then a lower bound."""
    n = 0
    for guess, truth in zip(chain, [*path, token]):
        if guess != truth:
            break
        n += 1
    return n


def path_tokens(tree: DraftTree, path: list[int]) -> list[int]:
    return [tree.tokens[i - 1] for i in path]


def tree_inputs(trees: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify pass's shape for trees of equal size: (depths [N, M+1] long, the root at 0;
    ancestors [N, M+1, M+1] bool), as `TargetRunner.forward_block` takes them."""
    depths = torch.tensor([[0, *t.depths] for t in trees], dtype=torch.long)
    return depths, torch.stack([ancestor_mask(t) for t in trees])
