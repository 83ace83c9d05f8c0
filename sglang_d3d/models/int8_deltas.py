"""The drafter's gated projections in int8, deltas included, for its passes on CPU.

With the target's projections in int8 (models/int8_linear.py) a drafter pass still read its
low-rank deltas in fp32: rank 32 on every projection of 30 layers is 9.8M parameters, 39 MB a
pass, more than the 34 MB of the int8 layers themselves, in 240 small products besides. Here
each fused projection carries its group's deltas in int8:
- x @ A^T rides along the base GEMM: the A matrices are R extra output rows of the same int8
  weight (2-10% more rows of a product already made, clean rows included, where it is unused);
- the B matrices (block-diagonal, scale folded in) are one fp32 product over the mask rows.
Measured on the default drafter, side by side in one process: a synchronous draft pass (9 rows), 1 thread 37.2 -> 36.3 ms, 2 threads 32.1 ->
30.5 ms; drafts accepted as with fp32 deltas (on 120 distilled blocks, 2.108 both). The B
products are fp32 rather than int8 GEMMs: for a few rows and a rank of 4-32 their cost is
the call's fixed overhead, not bytes, and in fp32 a block-4 draft pass took 27.8 ms against
31.0 (rank 4, 2 threads; rank 32: 28.2 against 30.2, and level at block 8).
"""

from __future__ import annotations

import torch

from sglang_d3d.models.adapters import GatedFused, LowRankDelta, delta_groups, delta_versions
from sglang_d3d.models.cpu_linear import fused_weight
from sglang_d3d.models.int8_linear import Int8Linear, Int8Setting


class Int8Gated:
    """One fused projection of a drafter layer and its gated deltas, in int8: x [..., K] ->
    [..., N], the target's projection everywhere plus the deltas at the rows the gate selects.
    `prepare` rebuilds it when training has changed a delta (tensor version counters); the
    drafter calls it when any delta changed (`D3DDrafter.hidden`), not every call (the check
    is 5 us, 120 times a pass)."""

    def __init__(self, deltas: tuple[LowRankDelta, ...], setting: Int8Setting = Int8Setting()) -> None:
        self.deltas, self.setting = deltas, setting
        self.gate = deltas[0].gate
        self._key: list[int] | None = None
        self.prepare()

    def prepare(self) -> None:
        if delta_versions(self.deltas) == self._key:
            return
        with torch.no_grad():
            w, b = fused_weight([m.base for m in self.deltas])  # the target's [N, K], [N]
            a = torch.cat([m.delta_a for m in self.deltas])  # [R, K]
            self.out, self.rank = w.shape[0], a.shape[0]
            bias = None if b is None else torch.cat([b, b.new_zeros(self.rank)])
            self.first = Int8Linear(torch.cat([w, a]), bias, self.setting)  # -> [..., N + R]
            # [R, N]: fp32, small (R = the group's ranks), read once per pass
            self.second = torch.block_diag(*[m.delta_b * m.scale for m in self.deltas]).T.contiguous()
        self._key = delta_versions(self.deltas)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = self.first(x)  # [..., N + R], fresh and contiguous
        g = self.gate
        if g.value is not None:
            flat = z.view(-1, self.out + self.rank)  # [rows, N + R]
            if g.value is True or g.span is not None:  # views: no gather, no scatter
                part = flat if g.value is True else flat[g.span[0] : g.span[1]]
                part[:, : self.out] += part[:, self.out :] @ self.second  # [M, R] @ [R, N]
            else:
                flat[g.rows, : self.out] += flat[g.rows, self.out :] @ self.second
        return z[..., : self.out]


def int8_layer(base, layer, setting: Int8Setting = Int8Setting()) -> GatedFused:
    """The int8 fast path of one drafter layer; base: the target's FusedLayer (its norms and
    activation, fp32)."""
    return GatedFused(base, *(Int8Gated(g, setting) for g in delta_groups(layer)))
