"""Token trees for sampled rows: exact verification by recursive rejection sampling.

A greedy tree holds the drafter's likeliest tokens (tree.py). A sampled row cannot: rejection
sampling is exact only for candidates *drawn* from the proposal q. So a sampled row keeps the
greedy tree's shape (how many children each node has, fixed by q alone, before any draw) and
fills each depth's sibling slots with tokens drawn from q_d without replacement: slot 0 is the
chain's own draft (already drawn from q_d), slots 1.. the next draws. The D3D drafter's q_d does
not depend on the guesses before depth d, so one set of draws per depth serves every parent.

Verification walks down from the root. At a node whose target distribution is p, its children
c_1..c_k (in draw order) are tried in turn: c_i is accepted with probability
min(1, p_i(c_i) / q_i(c_i)), where q_i is q_d without c_1..c_{i-1} (renormalised) and
p_1 = p; after a rejection p_{i+1} = norm(max(p_i - q_i, 0)). An accepted child is emitted
and the walk goes on from it; if every child is rejected, the next token is drawn from the
last residual (which has no mass on the rejected children) and the walk ends. Each step is
the standard rejection-sampling argument (the candidate is drawn from q_i, given the ones
before it), so every emitted token follows p exactly: recursive rejection sampling, as in
Jeon et al., "Recursive Speculative Decoding" (2024). With one child per node it is the
chain's rejection sampling (verify.py), uniform for uniform.

Guesses copied from the request's own text (lookup.py) join a sampled tree as nodes proposed
with probability one (`DraftTree.sure`, tree.graft): a point mass is a proposal like any other,
so the same step applies (accept c with probability p_i(c), then go on with p_i without c), and
the copy, fixed by the path before any coin is tossed, is a fair "draw" from it. Copied nodes
never stand in for drawn ones, so every draw keeps its place in its depth's order.

Why the shape is fixed before the draws: a shape that depended on the deeper draws would make
reaching a node depend on the draws tested there, and the candidate would no longer be a fair
draw from q_i.
"""

from __future__ import annotations

import torch

from sglang_d3d.speculative.sampling import RequestRandom, Role, as_role, inverse_cdf, on_device
from sglang_d3d.speculative.tree import DraftTree, children
from sglang_d3d.speculative.verify import residual

Generator = RequestRandom | torch.Generator | None


def sibling_ranks(tree: DraftTree) -> list[int]:
    """[M] each node's place among its parent's children, in the order they were added."""
    ranks = [0] * tree.size
    for kids in children(tree).values():
        for rank, node in enumerate(kids):
            ranks[node - 1] = rank
    return ranks


def draw_without_replacement(
    q: torch.Tensor,  # [V] a proposal distribution
    first: int,  # the first draw, already made from q
    k: int,  # draws wanted, the first included
    generator: Generator,
) -> list[int]:
    """`first` then k-1 more tokens from q, each from q without the ones before it
    (renormalised): an exponential race (the token with the largest q / Exp(1) wins), whose
    order of finish is sequential drawing without replacement. Past q's support the extra
    slots hold tokens of zero mass, which verification never tries."""
    if k <= 1:
        return [first][:k]
    rest = q.float().clone()
    rest[first] = 0.0
    # Exp(1) times as -log(1 - U): on this CPU 0.19 ms for 49152 against exponential_'s 0.94
    # (benchmarks/bench_sampling_ops.py), once per depth of every sampled drafter cycle
    u = torch.rand(rest.shape, generator=on_device(generator, rest.device), device=rest.device)
    race = u.neg_().log1p_().neg_()  # [V]
    keys = torch.where(rest > 0, rest / race, torch.full_like(rest, -1.0))
    keys[first] = -2.0  # never again, even past the support
    return [first, *keys.topk(k - 1).indices.tolist()]


def sample_tree(
    shape: DraftTree,  # the greedy tree built from q (tree.build_tree): its shape only
    chain: list[int],  # [D] the row's drafts, chain[d] drawn from q[d]
    q: torch.Tensor,  # [>=D, V] the drafter's proposal distributions
    generator: Generator,
) -> DraftTree:
    """The shape with each depth's sibling slots filled by draws without replacement from
    that depth's q, the chain's draft first (a request's drafting stream)."""
    generator = as_role(generator, Role.DRAFTING)
    ranks = sibling_ranks(shape)
    wanted = [0] * shape.depth
    for d, r in zip(shape.depths, ranks):
        wanted[d - 1] = max(wanted[d - 1], r + 1)
    draws = [draw_without_replacement(q[d], chain[d], k, generator) for d, k in enumerate(wanted)]
    tokens = tuple(draws[d - 1][r] for d, r in zip(shape.depths, ranks))
    return DraftTree(tokens, shape.parents, shape.depths)


def sampled_tree_accept(
    tree: DraftTree,  # from `sample_tree`
    q: torch.Tensor | None,  # [>=D, V] the proposals the tree's tokens were drawn from;
    # None: every node is proposed surely (tree.sure_chain)
    p: torch.Tensor,  # [M+1, V] the target's processed distribution after each node (0: root)
    generator: Generator,
) -> tuple[list[int], int]:
    """-> (accepted nodes, root excluded, in path order; the next token), every emitted token
    distributed as the target's p."""
    real = tree.size - tree.padded  # padding is never tried (tree.pad)
    kids = {node: [c for c in cs if c <= real] for node, cs in children(tree).items()}
    if q is None:
        if not all(tree.is_sure(i) for i in range(1, real + 1)):
            raise ValueError("a tree with drawn nodes needs the proposals they were drawn from")
    else:
        q = q[: tree.depth].to(device=p.device, dtype=torch.float32)  # the drafter may sit elsewhere
    # [M+1]: u[i-1] tries node i (each node is tried at most once), u[M] draws the next token
    u = torch.rand(real + 1, generator=on_device(generator, p.device), device=p.device).tolist()
    path, node = [], 0
    while True:
        nxt, dist = _try_children(kids.get(node, []), tree, q, p[node].float(), u)  # dist [V]
        if nxt is None:
            token = inverse_cdf(dist.unsqueeze(0), torch.tensor([u[-1]], device=p.device))
            return path, int(token[0])
        path.append(nxt)
        node = nxt


def _try_children(kids: list[int], tree: DraftTree, q: torch.Tensor | None, dist: torch.Tensor,
                  u: list[float]) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over one node's children (in order). -> (the child
    accepted, or None; the distribution left to draw the next token from). A child proposed
    surely (copied, `DraftTree.sure`) is a candidate whose proposal is a point mass: accepted
    with probability p_i(c); after a rejection p_{i+1} is p_i without c, renormalised. It
    takes nothing from the drafter's q_i, so its drawn siblings keep their draw order."""
    q_i = None  # [V] the drafter's proposal for the next drawn child, once one is tried
    for child in kids:
        token = tree.tokens[child - 1]
        if tree.is_sure(child):
            if u[child - 1] < float(dist[token]):
                return child, dist
            dist = _without(dist, token)
            continue
        if q_i is None:
            q_i = q[tree.depths[child - 1] - 1].clone()
        mass = q_i.sum()
        if float(q_i[token]) <= 0 or float(mass) <= 0:
            break  # not a draw from q_i (q's support is spent): nothing more to try
        q_i = q_i / mass
        if u[child - 1] * float(q_i[token]) < float(dist[token]):
            return child, dist
        dist = residual(dist, q_i)
        q_i[token] = 0.0
    return None, dist


def _without(dist: torch.Tensor, token: int) -> torch.Tensor:
    """norm(max(p - point mass at token, 0)): p with the token's mass removed. [V]"""
    point = torch.zeros_like(dist)
    point[token] = 1.0
    return residual(dist, point)
