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

import torch
from torch import nn

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


class Gate:
    """Which tokens of the current forward get the deltas: None (none), True (all) or a
    [N, T, 1] float tensor of 0/1."""

    def __init__(self) -> None:
        self.value: torch.Tensor | bool | None = None


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


class GatedFused:
    """Inference fast path: the target's fused, packed projections of one layer
    (models/fused.py FusedLayer, shared with the target runner) plus this layer's gated deltas.
    Same interface as FusedLayer, so decoder.run_layers takes either."""

    def __init__(self, base, layer: nn.Module) -> None:
        a, m = layer.self_attn, layer.mlp
        self.base = base
        self.input_norm, self.post_norm, self.act = base.input_norm, base.post_norm, base.act
        self._qkv, self._o = (a.q_proj, a.k_proj, a.v_proj), (a.o_proj,)
        self._gate_up, self._down = (m.gate_proj, m.up_proj), (m.down_proj,)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return plus_gated(self.base.qkv(x), self._qkv, x)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return plus_gated(self.base.o(x), self._o, x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = plus_gated(self.base.gate_up(x), self._gate_up, x).chunk(2, dim=-1)
        h = self.act(gate) * up
        return plus_gated(self.base.down(h), self._down, h)


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
