"""Drafter inputs as packs: one row of a drafter pass, laid out relative to the row's committed
cache length L (RoPE position = L + rel_pos, cache index = L + rel_write).

A block is the anchor (the last accepted token) and B-1 mask slots; every block position
predicts the next token (the anchor's output is draft 1), so a block gives B predictions: B-1
drafts and a guess of the bonus token (models/drafter.py). The anchor is causal (its cache entry must equal a plain prefix entry); the masks see the
prefix, the anchor and each other (bidirectional inside the block).

extend pack (a synchronous draft):       [x1 .. xm | masks]
    x: accepted tokens not yet in the drafter cache (causal, committed by the pass); xm is the
    anchor.
branch pack (asynchronous pre-drafting): [d1 .. dG | c_1 masks | c_2 masks | ...]
    d: the drafts the target is verifying right now (causal);
    branch b hypothesises "n_b drafts accepted, then token c_b": c_b (its anchor) sees
    d1..d_{n_b} and itself; its masks see d1..d_{n_b}, c_b and each other. Example, G = 3,
    branch (n=1, c=7): c sits at rel_pos 1 (right after d1), its masks from rel_pos 2.
    The d's are written at their final cache indices, so on a hit only c_b has to be moved
    (cache index L + branch_token_index(...) -> L + n_b), and on a miss d1..dn are already
    in place.
fused pack (verify and draft in one pass):  [c d1 .. dG | masks after d_j1 | masks after d_j2 ...]
    run over the target's own cache by a full-depth drafter (speculative/fused.py): the clean
    tokens are the target's verify block (causal, written where the target writes them), and
    each branch is B-1 masks anchored at a verify token itself (pack index j: "j drafts
    accepted"), seeing c, d1..dj and each other. No token is guessed: whatever the target
    emits after d_j, the masks already predict the tokens after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_d3d.models.drafter import MASK_ID


@dataclass
class Pack:
    input_ids: list[int] = field(default_factory=list)
    rel_pos: list[int] = field(default_factory=list)
    rel_write: list[int] = field(default_factory=list)
    sees: list[list[int]] = field(default_factory=list)  # [t]: pack indices token t attends to
    blocks: list[list[int]] = field(default_factory=list)  # [b]: pack indices of its mask slots
    num_commit: int = 0  # leading tokens that become part of the committed prefix

    def add(self, token: int, rel_pos: int, sees: list[int]) -> int:
        idx = len(self.input_ids)
        self.input_ids.append(token)
        self.rel_pos.append(rel_pos)
        self.rel_write.append(idx)
        self.sees.append(sees + [idx])
        return idx

    def add_block(self, anchor: int, context: list[int], block: int):
        """Append B-1 masks after `anchor` (a pack index); record the B prediction slots."""
        first = len(self.input_ids)
        masks = list(range(first, first + block - 1))
        for j in range(block - 1):
            self.add(MASK_ID, self.rel_pos[anchor] + 1 + j, [])
            self.sees[-1] = context + [anchor] + masks  # bidirectional inside the block
        self.blocks.append([anchor] + masks)

    def intra_mask(self, size: int) -> torch.Tensor:
        """[size, size] bool over pack indices; padding rows see only themselves."""
        m = torch.zeros(size, size, dtype=torch.bool)
        for t, seen in enumerate(self.sees):
            m[t, seen] = True
        for t in range(len(self.sees), size):
            m[t, t] = True
        return m


def extend_pack(new_tokens: list[int], block: int) -> Pack:
    """block == 0: just cache the tokens (prefill)."""
    p = Pack()
    for i, tok in enumerate(new_tokens):
        p.add(tok, i, list(range(i)))
    if block > 0:
        last = len(new_tokens) - 1
        p.add_block(last, list(range(last)), block)
    p.num_commit = len(new_tokens)
    return p


def branch_pack(drafts: list[int], branches: list[tuple[int, int]], block: int) -> Pack:
    """branches: (num_accepted, token) hypotheses."""
    p = Pack()
    for i, tok in enumerate(drafts):
        p.add(tok, i, list(range(i)))
    for n, tok in branches:
        ctx = list(range(n))
        c = p.add(tok, n, ctx)
        p.add_block(c, ctx, block)
    return p


def fused_pack(verify: list[int], anchors: list[int], block: int) -> Pack:
    """verify: the last accepted token then the drafts under verification; anchors: pack
    indices (0 .. len(verify) - 1) after which a branch of B-1 masks predicts the next block.
    blocks[0] is the verify block (its positions score the drafts), blocks[1 + k] branch k."""
    p = Pack()
    for i, tok in enumerate(verify):
        p.add(tok, i, list(range(i)))
    p.blocks.append(list(range(len(verify))))
    for j in anchors:
        p.add_block(j, list(range(j)), block)
    return p


def layout(packs: list[Pack], lens: list[int], t: int):
    """Packs padded to t inputs, each after its row's committed length. -> input ids, RoPE
    positions and cache write indices [N, t], and the attention mask [N, t, max(lens) + t]
    (the committed prefix, then the pack's own `sees`; padding sees only itself and writes to
    scratch past the pack)."""
    n = len(packs)
    span = max(lens) + t
    ids = torch.zeros(n, t, dtype=torch.long)
    pos = torch.zeros(n, t, dtype=torch.long)
    write = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, span, dtype=torch.bool)
    for r, (p, base) in enumerate(zip(packs, lens)):
        m = len(p.input_ids)
        ids[r, :m] = torch.tensor(p.input_ids)
        pos[r, :m] = base + torch.tensor(p.rel_pos)
        pos[r, m:] = base
        write[r] = base + torch.arange(t)
        write[r, :m] = base + torch.tensor(p.rel_write)
        mask[r, :, :base] = True
        mask[r, :, base : base + t] = p.intra_mask(t)
    return ids, pos, write, mask


def branch_token_index(num_drafts: int, branch: int, block: int) -> int:
    """Pack index (= rel cache index) of branch `branch`'s hypothesised token: each branch
    is its token plus B-1 masks."""
    return num_drafts + branch * block
