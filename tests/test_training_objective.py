"""The training example, its two passes and the losses: pure pieces, each alone, and the one
invariant that matters most: training and the engine see the same block layout."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.packing import extend_pack
from sglang_d3d.testing import tiny_hf_model
from sglang_d3d.training.evaluate import block_drafts
from sglang_d3d.training.forward import (
    block_hidden,
    clean_pass,
    pick_rows,
    target_hidden,
    teacher_source,
)
from sglang_d3d.training.losses import (
    accuracy_by_draft,
    hard_ce,
    kl_to_teacher,
    label_probs,
    slot_loss,
)
from sglang_d3d.training.objective import (
    IGNORE,
    block_mask,
    build_example,
    chain_weights,
    collate,
    draft_weights,
    sample_anchors,
)
from sglang_d3d.training.shards import Sample


def test_worked_example_positions_labels_and_draft_indices():
    ids = torch.arange(100, 112)  # x_0 .. x_11
    ex = build_example(ids, torch.tensor([5]), 4)
    assert ex.slot_pos.tolist() == [6, 7, 8]
    assert ex.labels.tolist() == [107, 108, 109]  # x_7, x_8, x_9
    assert ex.slot_draft.tolist() == [2, 3, 4]  # the anchor gives draft 1


def test_labels_past_the_end_are_ignored():
    ex = build_example(torch.arange(10), torch.tensor([7]), 4)
    assert ex.labels.tolist() == [9, IGNORE, IGNORE]


def test_mixed_block_sizes_per_anchor():
    ex = build_example(torch.arange(100, 120), torch.tensor([3, 9]), torch.tensor([3, 5]))
    assert ex.slot_pos.tolist() == [4, 5, 10, 11, 12, 13]
    assert ex.slot_draft.tolist() == [2, 3, 2, 3, 4, 5]
    assert ex.slot_block.tolist() == [0, 0, 1, 1, 1, 1]
    assert ex.labels.tolist() == [105, 106, 111, 112, 113, 114]
    m = collate([ex])["slot_mask"][0]
    assert m[0, 20:].tolist() == [True, True] + [False] * 4
    assert m[5, :20].sum() == 10 and m[5, 20:].tolist() == [False, False] + [True] * 4


def test_slots_see_prefix_up_to_anchor_and_own_block_only():
    ex = build_example(torch.arange(10), torch.tensor([3, 6]), 3)
    m = block_mask(10, ex.slot_anchor, ex.slot_block, clean_width=12)
    assert m.shape == (4, 12 + 4)
    assert m[0, :12].tolist() == [True] * 4 + [False] * 8  # x_0..x_3, no clean padding
    assert m[2, :12].tolist() == [True] * 7 + [False] * 5
    assert m[:2, 12:].tolist() == [[True, True, False, False]] * 2  # bidirectional in block
    assert m[2:, 12:].tolist() == [[False, False, True, True]] * 2  # blocks never mix


def test_anchors_leave_room_for_a_label():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=5, total_len=12, num=100, gen=gen)
    assert a.tolist() == list(range(4, 10))  # last prompt token .. T-3


def test_draft_weights_decay_and_skip_index_zero():
    w = draft_weights(4, gamma=1.0)
    assert w[0] == 0 and w[1] == 1.0
    assert torch.allclose(w[2:], torch.exp(-torch.tensor([1.0, 2.0, 3.0])))
    assert draft_weights(4, None)[1:].tolist() == [1.0] * 4


def test_chain_weights_multiply_the_targets_confidence_in_the_earlier_drafts_of_a_block():
    # one row: a block of drafts 2..4, a block of drafts 2..3, then a padding slot
    conf = torch.tensor([[0.5, 0.8, 0.9, 0.4, 0.7, 1.0]])
    draft = torch.tensor([[2, 3, 4, 2, 3, 1]])
    w = chain_weights(conf, draft)
    assert torch.allclose(w[0, :5], torch.tensor([1.0, 0.5, 0.4, 1.0, 0.4]))
    # a certain target keeps every slot; a token it never predicts cuts the rest of the block
    assert torch.allclose(chain_weights(torch.ones(1, 3), torch.tensor([[2, 3, 4]])), torch.ones(1, 3))
    cut = chain_weights(torch.tensor([[1.0, 0.0, 1.0, 1.0]]), torch.tensor([[2, 3, 4, 2]]))
    assert cut[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0], abs=1e-9)


def test_label_probs_are_the_softmax_at_the_label():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 3, 10, 3, 7])
    want = logits.softmax(-1)[torch.arange(5), labels]
    assert torch.allclose(label_probs(logits, labels), want)


def test_collate_pads_slots_without_labels_and_keeps_clean_causal():
    short = build_example(torch.arange(8), torch.tensor([2]), 3)
    long = build_example(torch.arange(12), torch.tensor([2, 6]), 3)
    b = collate([short, long])
    assert b["ids"].shape == (2, 12) and b["slot_pos"].shape == (2, 4)
    assert (b["labels"][0, 2:] == IGNORE).all()
    assert b["slot_mask"][0, 2:].sum(-1).tolist() == [1, 1]  # padding sees one key
    assert torch.equal(b["clean_mask"][1], torch.ones(12, 12, dtype=torch.bool).tril())


def test_kl_is_zero_against_itself_and_positive_otherwise():
    x = torch.randn(5, 11)
    assert float(kl_to_teacher(x, x)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_to_teacher(x, torch.randn(5, 11))) > 0


def test_hard_ce_and_empty_rows():
    logits = torch.tensor([[0.0, 10.0], [10.0, 0.0]])
    assert float(hard_ce(logits, torch.tensor([1, 0]))) < 1e-3
    empty = torch.zeros(0, 4, requires_grad=True)
    assert float(slot_loss(empty, None, torch.zeros(0, dtype=torch.long), "ce").detach()) == 0.0
    with pytest.raises(ValueError, match="kl"):
        slot_loss(logits, None, torch.tensor([1, 0]), "mse")


def test_accuracy_by_draft_index():
    student = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    acc = accuracy_by_draft(student, torch.tensor([1, 1, 1]), torch.tensor([2, 2, 3]), block=3)
    assert acc[2] == 0.5 and acc[3] == 1.0 and torch.isnan(acc[1])


def test_pick_rows_gathers_per_row_indices():
    h = torch.arange(2 * 4 * 1.0).view(2, 4, 1)
    idx = torch.tensor([[3, 0], [1, 2]])
    sel = torch.tensor([[True, False], [True, True]])
    assert pick_rows(h, idx, sel).view(-1).tolist() == [3.0, 5.0, 6.0]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = Decoder.from_hf(tiny_hf_model())
    drafter = D3DDrafter.init_from_target(target, None, block_size=4, rank=4, alpha=4.0)
    with torch.no_grad():
        for p in drafter.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, drafter


def _batch(n=20, anchors=(6, 11)):
    ids = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(1))
    return ids, collate([build_example(ids, torch.tensor(anchors), 4)])


def test_full_depth_clean_pass_is_the_target_and_is_the_teacher(pair):
    target, drafter = pair
    _, b = _batch()
    _, clean_h = clean_pass(drafter, b)
    assert drafter.is_full_depth
    assert torch.allclose(clean_h, target_hidden(target, b), atol=1e-5)
    assert teacher_source(drafter, target, b, clean_h) is clean_h
    pruned = drafter.prune([0, 2])
    _, ph = clean_pass(pruned, b)
    assert torch.allclose(teacher_source(pruned, target, b, ph), clean_h, atol=1e-5)


def test_training_block_matches_the_engine_draft_pass(pair):
    """A block's mask slots get the same logits in training (clean pass + block pass over its
    frozen keys) as in the engine's DraftRunner (same positions, same visibility)."""
    _, drafter = pair
    drafter = drafter.prune([0, 1, 3])  # pruned: the clean path differs from the target too
    ids, b = _batch()
    with torch.no_grad():
        past, clean_h = clean_pass(drafter, b)
        slots = block_hidden(drafter, b, past)[0].view(2, 3, -1)  # [K, B-1, H]
    for k, a in enumerate([6, 11]):
        ref = DraftRunner(drafter, 1, 64).run([(0, extend_pack(ids[: a + 1].tolist(), 4))])[0][0]
        assert torch.allclose(drafter.logits(clean_h[0, a]), ref[0], atol=1e-4)  # draft 1
        assert torch.allclose(drafter.logits(slots[k]), ref[1:], atol=1e-4)  # drafts 2..4


def test_a_few_training_steps_then_engine_and_evaluator_agree(pair):
    """Train a few steps, then the evaluator's greedy drafts equal the engine's, per position."""
    _, drafter = pair
    d = drafter.prune([0, 1, 2, 3])
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=1e-2)
    for p in d.trainable_parameters():
        p.requires_grad_(True)
    _, b = _batch(24, (5, 9, 14))
    sel = b["labels"] != IGNORE
    losses = []
    for _ in range(3):
        past, _ = clean_pass(d, b)
        loss = hard_ce(d.logits(block_hidden(d, b, past)[sel]), b["labels"][sel])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    ids = b["ids"][0]
    sample = Sample(ids[:4].numpy(), ids[4:].numpy(), 0, 0)
    anchors = torch.tensor([5, 9, 14])
    evald = block_drafts(d, [sample], [anchors], 4)  # [3, B-1]
    for k, a in enumerate(anchors.tolist()):
        eng = DraftRunner(d, 1, 64).run([(0, extend_pack(ids[: a + 1].tolist(), 4))])[0][0]
        assert evald[k].tolist() == eng.argmax(-1)[:3].tolist()
