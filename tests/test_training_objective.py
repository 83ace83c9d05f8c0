"""The D3D objective: masks, labels, slot weights, AR-loss coverage, and that a step learns."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import MASK_ID, D3DDrafter
from sglang_d3d.testing import tiny_hf_model
from sglang_d3d.training.losses import IGNORE, build_label_map, d3d_loss, map_labels
from sglang_d3d.training.objective import (
    ar_label_row,
    build_example,
    collate,
    position_weights,
    sample_anchors,
)


def test_mask_blocks_see_prefix_up_to_anchor_and_own_block_only():
    ids = torch.arange(10, 20)  # T = 10
    anchors, block = torch.tensor([3, 6]), 3
    ex = build_example(ids, anchors, block)
    m = ex.mask
    assert m.shape == (16, 16)
    assert torch.equal(m[:10, :10], torch.ones(10, 10, dtype=torch.bool).tril())
    assert not m[:10, 10:].any()  # clean tokens never see mask slots
    for k, a in enumerate([3, 6]):
        rows = range(10 + k * block, 10 + (k + 1) * block)
        for r in rows:
            seen = set(torch.nonzero(m[r]).flatten().tolist())
            assert seen == set(range(a + 1)) | set(rows)


def test_mask_slot_inputs_positions_and_labels():
    ids = torch.arange(10, 20)
    ex = build_example(ids, torch.tensor([3, 8]), 3)
    assert torch.equal(ex.input_ids[:10], ids)
    assert (ex.input_ids[10:] == MASK_ID).all()
    assert ex.positions[10:].tolist() == [4, 5, 6, 9, 10, 11]
    # Slot j of anchor a is labelled x_{a+j}; slots past the end carry no loss.
    assert ex.labels[10:].tolist() == [14, 15, 16, 19, IGNORE, IGNORE]
    assert (ex.labels[:10] == IGNORE).all()
    assert ex.block_pos[10:].tolist() == [1, 2, 3, 1, 2, 3]


def test_anchors_stay_in_the_response():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors(prompt_len=5, total_len=12, num=4, gen=gen)
        assert a.numel() == 4 and a.min() >= 4 and a.max() <= 10
        assert a.unique().numel() == 4


def test_position_weights_decay_as_configured():
    w = position_weights(4, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    assert torch.equal(position_weights(4, None), torch.ones(4))


def test_ar_labels_only_on_clean_prefix_positions():
    gen = torch.Generator().manual_seed(1)
    ids = torch.arange(50, 70)
    ar = ar_label_row(ids, lo=7, num=100, gen=gen)
    labelled = torch.nonzero(ar != IGNORE).flatten()
    assert labelled.tolist() == list(range(7, 19))  # every t in [lo, T-2]
    assert torch.equal(ar[labelled], ids[labelled + 1])
    ex = build_example(ids, torch.tensor([10]), 4, ar)
    assert (ex.ar_labels[20:] == IGNORE).all()  # no AR label on any mask slot
    assert ar_label_row(ids, 7, 3, gen).ne(IGNORE).sum() == 3  # subsampled
    many = build_example(ids, torch.arange(8, 18), 4, ar)  # more mask slots than clean tokens
    assert many.ar_labels.numel() == 60 and (many.ar_labels[20:] == IGNORE).all()


def test_collate_pads_without_loss_and_isolated_rows():
    a = build_example(torch.arange(8), torch.tensor([2]), 2)
    b = build_example(torch.arange(5), torch.tensor([1]), 2)
    batch = collate([a, b])
    assert batch["input_ids"].shape == (2, 10)
    assert (batch["labels"][1, 7:] == IGNORE).all()
    assert torch.equal(batch["mask"][1, 7:, :], torch.eye(10, dtype=torch.bool)[7:])


def _fake_head(weight):
    return lambda h: h @ weight.T


def test_block_loss_weights_slots_and_ignores_ar_when_weight_zero():
    torch.manual_seed(0)
    ids = torch.randint(0, 8, (12,))
    ex = build_example(ids, torch.tensor([4]), 3, ar_label_row(ids, 3, 5, torch.Generator()))
    batch = collate([ex])
    hidden = torch.randn(1, 15, 6)
    head_w = torch.randn(8, 6)
    w = torch.tensor([1.0, 0.0, 0.0])  # only slot 1 counts
    parts = d3d_loss(hidden, batch, w, _fake_head(head_w), ar_weight=0.0)
    ce = torch.nn.functional.cross_entropy(hidden[0, 12] @ head_w.T, ids[5])
    assert torch.allclose(parts.block, ce, atol=1e-6)
    assert torch.allclose(parts.total, parts.block)
    # The AR term is the next-token CE at the labelled clean positions only.
    parts = d3d_loss(hidden, batch, w, _fake_head(head_w), ar_weight=0.5)
    sel = batch["ar_labels"][0] != IGNORE
    ar = torch.nn.functional.cross_entropy(hidden[0][sel] @ head_w.T, batch["ar_labels"][0][sel])
    assert torch.allclose(parts.ar, ar, atol=1e-6)
    assert torch.allclose(parts.total, parts.block + 0.5 * ar, atol=1e-6)


def test_label_map_drops_tokens_outside_restricted_head():
    lm = build_label_map(torch.tensor([2, 5, 7]), 10)
    labels = torch.tensor([5, 3, IGNORE, 7, 2])
    assert map_labels(labels, lm).tolist() == [1, IGNORE, IGNORE, 2, 0]


@pytest.mark.parametrize("head_ids", [None, torch.tensor([0, 2, 3, 5, 8, 13, 21, 34, 55, 89])])
def test_one_step_reduces_loss_on_fixed_batch(head_ids):
    torch.manual_seed(0)
    target = Decoder.from_hf(tiny_hf_model().requires_grad_(False))
    drafter = D3DDrafter.init_from_target(target, [0, 3], block_size=4)
    for p in drafter.parameters():
        p.requires_grad_(True)
    if head_ids is not None:
        drafter.set_head(head_ids)
        lm = build_label_map(head_ids, target.spec.vocab_size)
        pool = head_ids
    else:
        lm, pool = None, torch.arange(target.spec.vocab_size)
    gen = torch.Generator().manual_seed(0)
    exs = []
    for _ in range(2):
        ids = pool[torch.randint(0, pool.numel(), (20,), generator=gen)]
        exs.append(build_example(ids, sample_anchors(6, 20, 3, gen), 4, ar_label_row(ids, 5, 4, gen)))
    batch = collate(exs)
    w = position_weights(4, 2.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def loss():
        h = drafter.hidden(batch["input_ids"], batch["positions"], batch["mask"])
        return d3d_loss(h, batch, w, drafter.head_logits, 0.2, lm).total

    before = loss()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = loss()
    assert float(after) < float(before.detach())


def test_training_block_matches_the_engine_draft_pass():
    """The packed training row must give a mask block the same logits as the engine's
    DraftRunner gives it at inference (same positions, same visibility)."""
    from sglang_d3d.models.draft_runner import DraftRunner
    from sglang_d3d.models.packing import extend_pack

    torch.manual_seed(0)
    target = Decoder.from_hf(tiny_hf_model())
    drafter = D3DDrafter.init_from_target(target, [0, 3], 4, block_layout="masks").eval()
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    ids = torch.randint(3, 96, (20,))
    anchors = torch.tensor([6, 11])
    b = collate([build_example(ids, anchors, 4)])
    with torch.no_grad():
        h = drafter.hidden(b["input_ids"], b["positions"], b["mask"])[0, 20:].view(2, 4, -1)
    for k, a in enumerate(anchors.tolist()):
        runner = DraftRunner(drafter, 1, 64)
        pack = extend_pack(ids[: a + 1].tolist(), 4, anchor_predicts=False)
        ref = runner.run([(0, pack)])[0][0]  # [B, V]
        assert torch.allclose(drafter.logits(h[k]), ref, atol=1e-4)
