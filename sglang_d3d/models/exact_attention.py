"""Attention whose result for a query does not depend on what else is in its pass.

Why: where a pass rounds its activations (bf16 into the 4-bit kernel, models/q4_linear.py), the
last-bit differences between an attention kernel run over 1 query and over 16, or over a span
padded with masked keys, flip roundings, and 30 layers grow them to ~0.2 in the logits
(measured on the default target: a 6-token verify against 6 plain steps), enough to change
greedy tokens between plain decoding and speculation. Here every query is its own attention
call over exactly the keys it sees, in cache order, so a token's keys, values and logits are
bitwise the same in a plain step, a chain verify and a token tree. The projections around it
are row-independent already (int4 kernel and oneDNN, tested).

Cost: one call per query per layer (about 15 us each on CPU), against one per pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_d3d.models.kv_cache import KVCache

# Per row, per query: the keys it sees, as a count (the first n cache entries, a view) or as
# cache indices [n] long (a token tree's path: cache prefix then its ancestors).
KeyPlan = list[list[int | torch.Tensor]]


def key_plan(mask: torch.Tensor) -> KeyPlan:
    """mask [N, T, S] bool (True = may attend) -> the keys each query sees."""
    seen = mask.sum(-1).tolist()  # [N][T]: one read each, not one per query
    lead = mask.int().cumprod(-1).sum(-1).tolist()  # [N][T] length of the leading run of True
    return [[n if n == lead[r][i] else mask[r, i].nonzero().squeeze(1) for i, n in enumerate(row)]
            for r, row in enumerate(seen)]


def exact_attention(q: torch.Tensor, cache: KVCache, li: int, slots: list[int],
                    plan: KeyPlan) -> torch.Tensor:
    """q [N, Hq, T, D] -> [N, Hq, T, D], query (r, i) over the keys plan[r][i] of cache row
    slots[r] in layer li."""
    out = torch.empty_like(q)
    for r, slot in enumerate(slots):
        for i, keys in enumerate(plan[r]):
            if isinstance(keys, int):
                k, v = cache.read(li, slice(slot, slot + 1), keys)  # [1, Hkv, n, D] views
            else:
                k = cache.k[li][slot, keys].unsqueeze(0).transpose(1, 2)  # same strides as a view
                v = cache.v[li][slot, keys].unsqueeze(0).transpose(1, 2)
            qi = q[r : r + 1, :, i : i + 1]  # [1, Hq, 1, D]
            out[r : r + 1, :, i : i + 1] = F.scaled_dot_product_attention(qi, k, v, enable_gqa=True)
    return out
