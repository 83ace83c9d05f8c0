"""The drafter's deltas inside SGLang's own forward: hooks on SGLang's fused projections.

A fused forward (fused_cycle.py) runs the verify rows and the next block's mask rows through
SGLang's model in one pass. The drafter is SGLang's layers plus low-rank deltas at mask rows
(models/adapters.py), so the only change to SGLang's forward is, on each of a layer's four
projections (qkv_proj, o_proj, gate_up_proj, down_proj), `y[mask rows] += delta(x[mask rows])`:
a forward hook per projection, which does nothing unless the drafter's gate names mask rows.
The gate is set only for the duration of a fused forward, so SGLang's prefill, plain and
verify passes run unchanged (verify rows are never in the gate).

The mask rows' input is the drafter's mask embedding, given through SGLang's own
`replace_embeds` / `replace_positions` (ForwardBatch): no change to the embedding layer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from sglang_d3d.models.adapters import StackedDelta
from sglang_d3d.sglang_worker.shared_layers import FusedLayer


def _hook(delta: StackedDelta):
    def hook(module, args, output):
        if delta.deltas[0].gate.value is None:
            return None
        if isinstance(output, tuple):  # SGLang's linear layers return (output, bias)
            return (delta(output[0], args[0]),) + tuple(output[1:])
        return delta(output, args[0])

    return hook


def install(layers: tuple[FusedLayer, ...], sglang_model) -> list:
    """One forward hook per projection of every SGLang layer; -> their handles."""
    handles = []
    for i, f in enumerate(layers):
        sg = sglang_model.model.layers[i]
        for module, delta in ((sg.self_attn.qkv_proj, f.qkv_delta),
                              (sg.self_attn.o_proj, f.o_delta),
                              (sg.mlp.gate_up_proj, f.gate_up_delta),
                              (sg.mlp.down_proj, f.down_delta)):
            handles.append(module.register_forward_hook(_hook(delta)))
    return handles


@contextmanager
def mask_rows(gate, rows: torch.Tensor, total: int, dtype: torch.dtype,
              span: tuple[int, int] | None = None):
    """The deltas apply at flat rows `rows` [M] of a forward of `total` rows while inside;
    `span`: (start, end) where those rows are one run (a batch of one)."""
    value = torch.zeros(total, 1, dtype=dtype, device=rows.device)
    value[rows] = 1
    gate.clear()
    gate.value, gate.rows, gate.span = value, rows, span
    try:
        yield
    finally:
        gate.clear()
