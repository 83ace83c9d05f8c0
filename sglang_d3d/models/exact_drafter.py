"""The drafter's passes on a 4-bit target's own C++ layer loop (models/csrc/exact_layers.cpp).

The D3D drafter is the target's layers plus low-rank deltas at mask slots (models/adapters.py).
Where the target runs on the GGUF's 4-bit weights through the C++ loop, a drafter pass is that
loop over the drafter's source layers, with each projection's delta added on the mask rows
only: one call for the whole pass, the weights read once for every row, and clean rows (the
accepted tokens, the anchor) computed exactly as the target computes them. Through PyTorch the
same pass took about 3.6 plain steps (a block of 4 after one new token, 1 thread); every small
operation between the projections was a torch call.
"""

from __future__ import annotations

import torch

from sglang_d3d.models.adapters import delta_modules
from sglang_d3d.models.exact_pass import ExactPass, ExactWeights, key_plan
from sglang_d3d.models.kv_cache import KVCache


def exact_base(drafter) -> tuple[ExactPass, ExactWeights] | None:
    """The target's C++ 4-bit pass and the weights of the drafter's layers on it, where the
    target runs on one (models/q4_target.py with the C++ kernels); else None."""
    target = drafter._shared["target"]
    exact = target.fused().exact
    if exact is None or not exact.weights.cpp:
        return None
    return exact, exact.weights.keep(drafter.cfg.source_layers)


def delta_operands(fused_layers) -> list[torch.Tensor]:
    """Per drafter layer, the a [R, K] and bt [R, N] (B transposed, scale folded in) of its
    qkv, o, gate_up and down deltas (models/adapters.py StackedDelta)."""
    out = []
    for layer in fused_layers:
        for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
            a, b = proj.deltas.weights()
            out += [a.float().contiguous(), b.float().T.contiguous()]
    return out


def prepare_exact(drafter) -> None:
    """Build the deltas' operands for the C++ loop now, not in the first pass."""
    for layer in drafter.fused_layers(False):
        layer.prepare()
    _deltas(drafter)


def _deltas(drafter) -> list[torch.Tensor]:
    """delta_operands of the drafter, kept until training changes a delta."""
    kept = getattr(drafter, "_exact_deltas", None)
    if kept is None:  # the delta tensors, once: their version counters are the key
        tensors = [t for _, m in delta_modules(drafter.layers) for t in (m.delta_a, m.delta_b)]
        kept = drafter._exact_deltas = [tensors, None, None]
    key = [t._version for t in kept[0]]
    if key != kept[1]:
        kept[1:] = [key, delta_operands(drafter.fused_layers(False))]
    return kept[2]


def exact_hidden(drafter, input_ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor,
                 cache: KVCache, slots: list[int], write_at: torch.Tensor, is_mask: torch.Tensor,
                 coarse: bool = False) -> torch.Tensor:
    """input_ids [N, T] (MASK_ID at mask slots, is_mask [N, T] bool), RoPE positions and cache
    write indices [N, T], attn_mask [N, T, S] -> [N, T, H] final-normed hidden states, the
    drafter's `hidden` on the target's C++ loop; keys and values go to `cache` (the drafter's,
    or the target's own for a full-depth drafter). `coarse`: the projections' inputs rounded to
    8 bits (ExactPass), only where `cache` is the drafter's own."""
    exact, weights = exact_base(drafter)
    target = drafter._shared["target"]
    h = drafter.embed(input_ids).float()  # [N, T, H]
    cos, sin = target.rope_at(positions, h)
    deltas = _deltas(drafter)
    masked = is_mask.reshape(-1).to(torch.int64).tolist()
    return exact(h, cos, sin, cache, slots, write_at, key_plan(attn_mask), weights, deltas, masked,
                 coarse)
