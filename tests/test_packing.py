"""Drafter pack layouts: masks, positions and the indices commits rely on."""

from __future__ import annotations

import torch

from sglang_d3d.models.drafter import MASK_ID
from sglang_d3d.models.packing import branch_pack, branch_token_index, extend_pack


def test_extend_pack_layout():
    p = extend_pack([10, 11, 12], block=4)
    assert p.input_ids == [10, 11, 12, MASK_ID, MASK_ID, MASK_ID]
    assert p.rel_pos == [0, 1, 2, 3, 4, 5]
    assert p.blocks == [[2, 3, 4, 5]]  # anchor (last token) + 3 masks
    assert p.num_commit == 3
    m = p.intra_mask(7)
    assert m[:3, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())  # tokens causal
    assert not m[2, 3:].any()  # the anchor does not see the masks
    assert m[3:6, :6].all()  # masks see everything in the pack, each other included
    assert m[6].tolist() == [False] * 6 + [True]  # padding sees only itself


def test_branch_pack_layout():
    drafts = [20, 21, 22]
    p = branch_pack(drafts, [(1, 7), (3, 9)], block=3)
    # [d1 d2 d3 | c=7 M M | c=9 M M]
    assert p.input_ids == [20, 21, 22, 7, MASK_ID, MASK_ID, 9, MASK_ID, MASK_ID]
    assert p.rel_pos == [0, 1, 2, 1, 2, 3, 3, 4, 5]
    assert p.blocks == [[3, 4, 5], [6, 7, 8]]
    assert branch_token_index(3, 0, 3) == 3 and branch_token_index(3, 1, 3) == 6
    m = p.intra_mask(9)
    assert m[3].tolist() == [True, False, False, True] + [False] * 5  # c sees d1 and itself
    assert m[4].tolist() == [True, False, False, True, True, True] + [False] * 3
    assert m[6, :7].tolist() == [True, True, True, False, False, False, True]
    assert not m[4, 6:].any()  # branches never see each other
    assert p.num_commit == 0
