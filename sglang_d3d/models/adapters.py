"""Low-rank deltas over the target's own projections, switched on only at mask slots.

The D3D drafter is the target's layers (shared, frozen) plus, on every projection of every
kept layer, a delta `scale * B @ A` (rank r) that applies to MASK tokens only. Clean tokens (the
accepted prefix and the block's anchor) run the unchanged target layers, so:
- at full depth the drafter's prefix cache and its anchor prediction (draft 1) are exactly the
  target's: draft 1 is always accepted under greedy decoding;
- training runs the clean prefix once without gradients and spends every backward pass on the
  mask blocks (training/forward.py);
- the checkpoint holds only the deltas and the mask embedding (a few MB), never a copy of the
  target (models/drafter.py).

HF's MLP calls its projections itself, so the per-token switch cannot be an argument: it is a
`Gate` that the drafter sets for the duration of one forward and every wrapper of that drafter
reads.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn

from sglang_d3d.models.cpu_linear import probe

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


class Gate:
    """Which tokens of the current forward get the deltas: None (none), True (all) or a
    [N, T, 1] float tensor of 0/1; `rows` are then the flat indices of the mask tokens (the
    inference path computes the deltas on those rows only), and `span` (start, end) where
    they are one run of rows: a view then replaces gathering and scattering them (a batch of
    one's masks follow its clean tokens; measured: a third of the deltas' time per pass)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | bool | None = None
        self.rows: torch.Tensor | None = None  # [M] long
        self.span: tuple[int, int] | None = None

    def set(self, is_mask: torch.Tensor, dtype: torch.dtype) -> None:
        """is_mask [N, T] bool. No mask token: skip the deltas; all: no gating product."""
        self.clear()
        if not bool(is_mask.any()):
            return
        if bool(is_mask.all()):
            self.value = True
            return
        self.value = is_mask.unsqueeze(-1).to(dtype)
        self.rows = is_mask.reshape(-1).nonzero().squeeze(1)
        first, last = int(self.rows[0]), int(self.rows[-1])
        if last - first + 1 == self.rows.numel():
            self.span = (first, last + 1)

    def clear(self) -> None:
        self.value, self.rows, self.span = None, None, None


class LowRankDelta(nn.Module):
    """y = base(x) + gate * scale * (x @ A^T) @ B^T. `base` is the target's Linear (frozen,
    shared); B starts at zero, so a fresh delta leaves the target unchanged."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gate: Gate,
                 gen: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        w = base.weight
        self.delta_a = nn.Parameter(torch.empty(rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.delta_b = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.delta_a, a=math.sqrt(5), generator=gen)
        self.scale = alpha / rank
        self.gate = gate

    def delta(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, in] -> [N, T, out], ungated
        return (x @ self.delta_a.T) @ self.delta_b.T * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, in] -> [N, T, out]
        return plus_gated(self.base(x), (self,), x)


def plus_gated(y: torch.Tensor, deltas: tuple[LowRankDelta, ...], x: torch.Tensor) -> torch.Tensor:
    """y + the deltas of x (concatenated along the output, as fused projections lay them out),
    at the tokens the gate selects."""
    g = deltas[0].gate.value
    if g is None:
        return y
    d = torch.cat([m.delta(x) for m in deltas], -1) if len(deltas) > 1 else deltas[0].delta(x)
    return y + (d if g is True else d * g)


class StackedDelta:
    """Inference form of the deltas of one fused projection (q/k/v, gate/up, o or down): the
    A matrices stacked [sum r, in] and the B matrices block-diagonal [sum out, sum r] with the
    scale folded in, so the group costs two small matmuls on the mask rows instead of 3 per
    delta plus a concatenation (the per-delta form was about a third of a drafter pass on CPU).
    A few mask rows in fp32 on a CPU go through OpenBLAS instead (`SmallDelta`).
    Rebuilt when training changes a delta (tensor version counters)."""

    def __init__(self, deltas: tuple[LowRankDelta, ...]) -> None:
        self.deltas = deltas
        self._key: list[int] | None = None
        self.a = self.b = None
        self.small: SmallDelta | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = delta_versions(self.deltas)
        if key != self._key:
            with torch.no_grad():
                self.a = torch.cat([m.delta_a for m in self.deltas]).contiguous()  # [sum r, in]
                self.b = torch.block_diag(*[m.delta_b * m.scale for m in self.deltas])  # [out, sum r]
                self.small = SmallDelta.build(self.deltas)
            self._key = key
        return self.a, self.b

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [N, T, out] (the base projection of x [N, T, in]) plus the deltas at mask rows."""
        gate = self.deltas[0].gate
        if gate.value is None:
            return y
        if torch.is_grad_enabled():  # training through the fast path: the autograd form
            return plus_gated(y, self.deltas, x)
        a, b = self.weights()
        if gate.value is True:
            return y + self._delta(x.reshape(-1, x.shape[-1]), a, b).view(y.shape)
        if gate.span is not None and y.is_contiguous():  # one run of rows: views; y is fresh
            lo, hi = gate.span
            ys = y.view(-1, y.shape[-1])[lo:hi]  # [M, out]
            ys += self._delta(x.reshape(-1, x.shape[-1])[lo:hi], a, b)
            return y
        xs = x.reshape(-1, x.shape[-1]).index_select(0, gate.rows)  # [M, in]
        d = self._delta(xs, a, b)  # [M, out]
        return y.reshape(-1, y.shape[-1]).index_add(0, gate.rows, d).view(y.shape)

    def _delta(self, xs: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """xs [M, in] -> [M, out]."""
        if self.small is not None and xs.shape[0] <= SmallDelta.MAX_ROWS:
            return self.small(xs)
        return (xs @ a.T) @ b.T


def delta_versions(deltas: tuple[LowRankDelta, ...]) -> list[int]:
    """The deltas' tensor version counters: they change whenever training updates a delta, so
    weights derived from the deltas for inference know when to rebuild."""
    return [t._version for m in deltas for t in (m.delta_a, m.delta_b)]


class SmallDelta:
    """The deltas of one group for a few rows, through numpy's OpenBLAS: with MKL, torch's
    CPU GEMM on this project's AMD CPU, a [3, 576] x [576, 96] product takes 14 us and
    OpenBLAS 6 us (measured); a drafter pass makes 240 of them. The B matrices stay apart
    (no block-diagonal zeros to read). fp32 on a CPU with OpenBLAS only."""

    MAX_ROWS = 32  # above this, torch's multi-threaded GEMM wins

    def __init__(self, a_t, parts) -> None:
        self.a_t = a_t  # [in, sum r] numpy
        self.parts = parts  # [(rank slice, B_i.T * scale [r_i, out_i] numpy)]

    @classmethod
    def build(cls, deltas: tuple[LowRankDelta, ...]) -> SmallDelta | None:
        w = deltas[0].delta_a
        if w.dtype != torch.float32 or w.device.type != "cpu" or probe().openblas is None:
            return None
        a_t = torch.cat([m.delta_a for m in deltas]).T.contiguous().numpy()
        parts, r = [], 0
        for m in deltas:
            k = m.delta_a.shape[0]
            parts.append((slice(r, r + k), (m.delta_b * m.scale).T.contiguous().numpy()))
            r += k
        return cls(a_t, parts)

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:
        """xs [M, in] -> [M, out]."""
        t = xs.contiguous().numpy() @ self.a_t  # [M, sum r]
        outs = [t[:, rs] @ bt for rs, bt in self.parts]
        return torch.from_numpy(outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1))


class WithDeltas:
    """A target projection (fp32 PackedLinear) plus its group's gated deltas: x [..., K] ->
    [..., N], the call of the projection alone."""

    def __init__(self, base, deltas: StackedDelta) -> None:
        self.base, self.deltas = base, deltas

    def prepare(self) -> None:
        self.deltas.weights()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.deltas(self.base(x), x)


class GatedFused:
    """Inference fast path of one drafter layer: the target's norms and activation (models/
    fused.py FusedLayer, shared with the target runner) and four gated projections (q/k/v,
    o, gate/up, down), either the target's fused, packed ones plus the deltas (`full`) or an
    int8 copy with int8 deltas (models/int8_deltas.py). Same interface as FusedLayer, so
    decoder.run_layers takes either."""

    def __init__(self, base, qkv, o, gate_up, down) -> None:
        self.input_norm, self.post_norm, self.act = base.input_norm, base.post_norm, base.act
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    @classmethod
    def full(cls, base, layer: nn.Module) -> GatedFused:
        """base: the target's FusedLayer for `layer`'s source layer."""
        stacked = [StackedDelta(g) for g in delta_groups(layer)]
        return cls(base, *(WithDeltas(p, d) for p, d in
                           zip((base.qkv, base.o, base.gate_up, base.down), stacked)))

    def prepare(self) -> None:
        """Build every group's inference weights now (rebuilt if training changes them)."""
        for p in (self.qkv, self.o, self.gate_up, self.down):
            p.prepare()

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def delta_groups(layer: nn.Module) -> tuple[tuple[LowRankDelta, ...], ...]:
    """The deltas of an adapted layer grouped as the fused projections lay them out:
    (q, k, v), (o,), (gate, up), (down,)."""
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy that shares every parameter but owns its submodule table, so replacing a
    submodule in the copy leaves the original (the target's layer) untouched."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def adapted_layer(layer: nn.Module, rank: int, alpha: float, gate: Gate,
                  gen: torch.Generator | None = None) -> nn.Module:
    """A view of a target decoder layer whose projections carry gated low-rank deltas."""
    out = _shallow(layer)
    out.self_attn = _shallow(layer.self_attn)
    out.mlp = _shallow(layer.mlp)
    for part, names in ((out.self_attn, ATTN_PROJ), (out.mlp, MLP_PROJ)):
        for name in names:
            setattr(part, name, LowRankDelta(getattr(part, name), rank, alpha, gate, gen))
    return out


def delta_modules(layers: nn.ModuleList) -> list[tuple[str, LowRankDelta]]:
    """(name, module) of every delta, in a stable order: '<layer>.<proj>'."""
    out = []
    for i, layer in enumerate(layers):
        for part, names in ((layer.self_attn, ATTN_PROJ), (layer.mlp, MLP_PROJ)):
            out += [(f"{i}.{n}", getattr(part, n)) for n in names]
    return out
