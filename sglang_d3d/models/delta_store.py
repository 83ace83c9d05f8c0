"""How a drafter checkpoint stores its deltas: floats, or int8 / int4 with group scales.

A full-depth drafter's rank-32 deltas are 9.8M numbers: 19.6 MB in bf16. The repository keeps
every shipped checkpoint in its history and must stay small, so drafters ship quantised:
the same deltas take 9.8 MB (int8) or 5.5 MB (int4), at most 0.4% of accepted length
(docs/drafter.md, "Checkpoints, resuming, size").

Symmetric round-to-nearest per group of `group` consecutive numbers along each row (a row of A
is one rank's input direction, a row of B one output's mixing of the ranks), one bf16 scale per
group; int4 packs two numbers a byte (low nibble first). Quantisation divides by the stored
(rounded) scale, so the only extra error is rounding. The mask embedding stays in bf16: 576
numbers.

Keys: a float store keeps the drafter's own names (`delta.<layer>.<proj>.a`); a quantised one
stores `<name>.q` (int8, or uint8 for int4) and `<name>.scale` (bf16 [rows, groups]). A matrix
whose rows are shorter than a group but whose columns divide into groups (B at rank 32 or
less: [out, r]) is stored transposed, `<name>.qt` and `<name>.scale_t`: one scale per 64
outputs of a rank instead of one per output's r numbers. At rank 4 a scale a row cost as
many bytes as the numbers it scales (`d3d compact --rank`, models/delta_rank.py). Files
written before keep `.q` for every matrix and load as they did.
"""

from __future__ import annotations

import torch

FLOAT = "float"  # the deltas as saved (bf16 by default): what training writes
STORES = {FLOAT: 0, "int8": 8, "int4": 4}  # store -> bits (0: floats)
GROUP = 64  # numbers per scale, where a row divides evenly (else one scale per row)


def group_size(cols: int, group: int = GROUP) -> int:
    """The group a row of `cols` numbers is quantised in: `group` where it divides the row."""
    return group if cols % group == 0 else cols


def quantize(w: torch.Tensor, bits: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (q [R, C] int8 in [-qmax, qmax], scale [R, C / g] bf16)."""
    rows, cols = w.shape
    g = group_size(cols, group)
    qmax = 2 ** (bits - 1) - 1
    wg = w.detach().float().reshape(rows, cols // g, g)  # [R, G, g]
    scale = (wg.abs().amax(-1) / qmax).to(torch.bfloat16)  # [R, G], as stored
    div = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q = torch.round(wg / div).clamp(-qmax, qmax).to(torch.int8)  # [R, G, g]
    return q.reshape(rows, cols), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [R, C] int8, scale [R, G] -> [R, C] fp32."""
    rows, cols = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(rows, groups, cols // groups) * scale.float().unsqueeze(-1)
    return w.reshape(rows, cols)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] int8 in [-7, 7] -> [R, ceil(C / 2)] uint8, two numbers a byte."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # [R, C] in [1, 15]
    if u.shape[1] % 2:
        u = torch.cat([u, u.new_full((u.shape[0], 1), 8)], 1)  # a zero to pad the pair
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """[R, ceil(C / 2)] uint8 -> q [R, C] int8."""
    lo, hi = packed & 0xF, packed >> 4
    u = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)[:, :cols]
    return u.to(torch.int8) - 8


def transposed(shape: torch.Size, group: int = GROUP) -> bool:
    """Whether a [R, C] matrix is quantised as its transpose: rows too short for a group,
    columns that divide into groups."""
    rows, cols = shape
    return cols < group and rows % group == 0


def stored_keys(name: str, t: bool) -> tuple[str, str]:
    """(values key, scales key) of a quantised matrix, stored by rows or transposed (`t`)."""
    return (f"{name}.qt", f"{name}.scale_t") if t else (f"{name}.q", f"{name}.scale")


def encode_state(state: dict[str, torch.Tensor], store: str,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The drafter's own state (models/drafter.py own_state) as `store` keeps it; float
    stores in `dtype`."""
    bits = _bits(store)
    out = {}
    for k, v in state.items():
        v = v.detach()
        if bits and k.startswith("delta."):
            t = transposed(v.shape)
            q, scale = quantize(v.T.contiguous() if t else v, bits)
            q_key, s_key = stored_keys(k, t)
            out[q_key], out[s_key] = (pack_int4(q) if bits == 4 else q), scale
        else:
            out[k] = v.to(dtype if not bits else torch.bfloat16).contiguous()
    return out


def decode_state(stored: dict[str, torch.Tensor], store: str,
                 shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The drafter's own state back from what `store` keeps; shapes: the drafter's own
    tensors' shapes (an int4 row's packed bytes do not say whether its count was odd). Keys
    it does not know pass through, for the caller to refuse by name."""
    bits = _bits(store)
    if not bits:
        return dict(stored)
    out = dict(stored)
    for n, shape in shapes.items():
        for t in (False, True):
            q_key, s_key = stored_keys(n, t)
            if q_key in stored and s_key in stored:
                q = out.pop(q_key)
                cols = shape[0] if t else shape[-1]
                w = dequantize(unpack_int4(q, cols) if bits == 4 else q, out.pop(s_key))
                out[n] = w.T.contiguous() if t else w
    return out


def _bits(store: str) -> int:
    if store not in STORES:
        raise ValueError(f"unknown delta store {store!r}; one of {sorted(STORES)}")
    return STORES[store]
