"""Gated low-rank deltas: the autograd form and the stacked inference form agree."""

import pytest
import torch
from torch import nn

from sglang_d3d.models.adapters import Gate, LowRankDelta, SmallDelta, StackedDelta, plus_gated
from sglang_d3d.models.cpu_linear import probe


def _group(gate: Gate, outs=(12, 4, 4), rank=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    deltas = []
    for out in outs:
        base = nn.Linear(8, out, bias=False)
        d = LowRankDelta(base, rank, alpha=6.0, gate=gate, gen=gen)
        with torch.no_grad():
            d.delta_b.normal_(generator=gen)  # a fresh B is zero: make the delta visible
        deltas.append(d)
    return tuple(deltas)


def _base(deltas, x):  # [N, T, in] -> [N, T, sum out], the fused projection without deltas
    return torch.cat([d.base(x) for d in deltas], -1)


@pytest.mark.parametrize("small_rows", [SmallDelta.MAX_ROWS, 0])  # OpenBLAS path, torch path
@pytest.mark.parametrize("mask", [[[0, 1, 1, 0], [1, 0, 0, 1]], [[1, 1, 1, 1], [1, 1, 1, 1]],
                                  [[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 0, 1, 1], [1, 1, 0, 0]]])
def test_stacked_form_matches_per_delta_form(mask, small_rows, monkeypatch):
    """Scattered mask rows, all rows, none, and one run of rows (views, no gather)."""
    monkeypatch.setattr(SmallDelta, "MAX_ROWS", small_rows)
    gate = Gate()
    deltas = _group(gate)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))  # [N, T, in]
    gate.set(torch.tensor(mask, dtype=torch.bool), x.dtype)
    want = plus_gated(_base(deltas, x), deltas, x)
    with torch.inference_mode():
        got = StackedDelta(deltas)(_base(deltas, x), x)
    assert torch.allclose(got, want, atol=1e-6)
    is_mask = torch.tensor(mask, dtype=torch.bool).unsqueeze(-1)
    # clean tokens keep the base projection exactly
    assert torch.equal(torch.where(is_mask, 0, got), torch.where(is_mask, 0, _base(deltas, x)))
    if any(map(any, mask)):
        assert not torch.allclose(got, _base(deltas, x))


def test_stacked_form_follows_training_updates():
    """The stacked weights are rebuilt when an optimiser changes a delta in place."""
    gate = Gate()
    deltas = _group(gate, outs=(6,))
    stacked = StackedDelta(deltas)
    x = torch.randn(1, 3, 8)
    gate.set(torch.tensor([[1, 0, 1]], dtype=torch.bool), x.dtype)
    with torch.inference_mode():
        before = stacked(_base(deltas, x), x)
    with torch.no_grad():
        deltas[0].delta_b.mul_(2.0)
    with torch.inference_mode():
        after = stacked(_base(deltas, x), x)
    assert torch.allclose(after, plus_gated(_base(deltas, x), deltas, x), atol=1e-6)
    assert not torch.allclose(before, after)


def test_gate_rows_are_the_mask_tokens():
    gate = Gate()
    gate.set(torch.tensor([[False, True], [True, False]]), torch.float32)
    assert gate.rows.tolist() == [1, 2] and gate.span == (1, 3)
    gate.set(torch.tensor([[True, False], [False, True]]), torch.float32)
    assert gate.rows.tolist() == [0, 3] and gate.span is None
    gate.clear()
    assert gate.value is None and gate.rows is None and gate.span is None


def test_small_delta_is_built_for_fp32_cpu_only():
    gate = Gate()
    stacked = StackedDelta(_group(gate))
    stacked.weights()
    assert (stacked.small is not None) == (probe().openblas is not None)
    double = StackedDelta(tuple(d.double() for d in _group(Gate())))
    double.weights()
    assert double.small is None
