"""The shared drafter's layer loop over SGLang's fused projections.

SGLang keeps q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`. The drafter's HF
modules see them as row slices (pool_draft.tie_to_sglang), which costs three and two matmuls
where SGLang's layout needs one each. Here a layer runs SGLang's fused tensors as they are (four
matmuls a layer, no copy), and the drafter's deltas stacked to the same layout
(models/adapters.StackedDelta: A stacked, B block-diagonal), applied at the mask rows only.
Norms, RoPE and attention are the drafter's own (models/decoder.py), so a pass computes what
`run_layers` over the drafter's modules computes, up to the order of floating-point sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_d3d.models.adapters import StackedDelta
from sglang_d3d.models.decoder import Batch, _rope, _sdpa, rope_tables
from sglang_d3d.models.drafter import D3DDrafter


@dataclass(frozen=True)
class FusedLayer:
    """One drafter layer over SGLang's fused tensors (views) and its stacked deltas."""

    layer: object  # the drafter's adapted HF layer: norms, q/k norms, the MLP's activation
    qkv: torch.Tensor  # [q + 2kv, H] SGLang's qkv_proj.weight
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, q]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    qkv_delta: StackedDelta
    o_delta: StackedDelta
    gate_up_delta: StackedDelta
    down_delta: StackedDelta


def fused_layers(drafter: D3DDrafter, sglang_model) -> tuple[FusedLayer, ...]:
    out = []
    for i, layer in enumerate(drafter.layers):
        sg = sglang_model.model.layers[i]
        a, m = layer.self_attn, layer.mlp
        out.append(FusedLayer(
            layer, sg.self_attn.qkv_proj.weight, getattr(sg.self_attn.qkv_proj, "bias", None),
            sg.self_attn.o_proj.weight, sg.mlp.gate_up_proj.weight, sg.mlp.down_proj.weight,
            StackedDelta((a.q_proj, a.k_proj, a.v_proj)), StackedDelta((a.o_proj,)),
            StackedDelta((m.gate_proj, m.up_proj)), StackedDelta((m.down_proj,)),
        ))  # fmt: skip
    return tuple(out)


def run_fused(layers: tuple[FusedLayer, ...], drafter: D3DDrafter, h: torch.Tensor,
              b: Batch) -> torch.Tensor:
    """h [N, T, H] embeddings -> [N, T, H] before the final norm; `b.past` holds each layer's
    prefix keys and values, `b.mask` [N, T, P + T]."""
    arch = drafter.arch
    n, t, _ = h.shape
    cos, sin = rope_tables(*drafter._shared["rot"](h, b.positions))
    kv = arch.num_kv_heads * arch.head_dim
    for li, f in enumerate(layers):
        attn = f.layer.self_attn
        x = f.layer.input_layernorm(h)
        qkv = f.qkv_delta(F.linear(x, f.qkv, f.qkv_bias), x)
        q, k, v = qkv.split([arch.num_heads * arch.head_dim, kv, kv], dim=-1)
        q = q.view(n, t, arch.num_heads, arch.head_dim)
        k = k.view(n, t, arch.num_kv_heads, arch.head_dim)
        v = v.view(n, t, arch.num_kv_heads, arch.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        pk, pv = b.past[li]
        out = _sdpa(q, torch.cat([pk, k], 2), torch.cat([pv, v.transpose(1, 2)], 2), b.mask)
        out = out.transpose(1, 2).reshape(n, t, -1)
        h = h + f.o_delta(F.linear(out, f.o), out)
        x = f.layer.post_attention_layernorm(h)
        gate, up = f.gate_up_delta(F.linear(x, f.gate_up), x).chunk(2, dim=-1)
        act = f.layer.mlp.act_fn(gate) * up
        h = h + f.down_delta(F.linear(act, f.down), act)
    return h
