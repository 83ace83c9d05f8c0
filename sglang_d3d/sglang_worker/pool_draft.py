"""A full-depth drafter inside SGLang: SGLang's own target weights, SGLang's own KV pool.

A full-depth D3D drafter is the target's layers plus low-rank deltas that apply at mask slots
only (models/adapters.py). Its clean tokens therefore compute exactly the target, so:

- its layers are SGLang's loaded tensors, taken as views (`tie_to_sglang`): q/k/v are row slices
  of SGLang's fused `qkv_proj`, gate/up of its `gate_up_proj`; the drafter holds only its deltas
  and mask embedding;
- its prefix keys and values are the target's, already in SGLang's paged KV pool: a draft pass
  reads them through `req_to_token` (`PoolPrefix`), so there is no drafter prefill and no
  drafter cache, only the pass's own block rows (scratch that lives for one pass).

One draft pass per cycle: each request's block [x_last, mask x (B-1)] at positions L .. L+B-1,
where L is SGLang's committed KV length (x_last's KV is written by the next verify). The anchor
x_last is causal (it sees the prefix and itself); the masks see the prefix, the anchor and each
other. Output j predicts the token after block position j: drafts d1 .. d_{B-1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.models.decoder import Batch, run_layers
from sglang_d3d.models.drafter import MASK_ID, D3DDrafter
from sglang_d3d.sglang_worker.shared_layers import run_fused

ATTN = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class LayerViews:
    """How one SGLang decoder layer's fused tensors split into HF's named projections."""

    q: int  # rows of q in qkv_proj (num_heads * head_dim on this rank)
    kv: int  # rows of k, and of v
    inter: int  # rows of gate, and of up, in gate_up_proj


def sglang_layer(model, i: int):
    return model.model.layers[i]


def split_views(layer, views: LayerViews) -> dict[str, torch.Tensor]:
    """SGLang layer -> {HF parameter name: view of SGLang's tensor} (no copy)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.qkv_proj.weight.split([views.q, views.kv, views.kv], 0)
    gate, up = mlp.gate_up_proj.weight.split([views.inter, views.inter], 0)
    out = {
        "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": attn.o_proj.weight,
        "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": mlp.down_proj.weight,
        "input_layernorm.weight": layer.input_layernorm.weight,
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
    }
    bias = getattr(attn.qkv_proj, "bias", None)
    if bias is not None:  # Qwen2-style q/k/v biases
        qb, kb, vb = bias.split([views.q, views.kv, views.kv], 0)
        out.update({"self_attn.q_proj.bias": qb, "self_attn.k_proj.bias": kb,
                    "self_attn.v_proj.bias": vb})
    for name in ("q_norm", "k_norm"):  # Qwen3 normalises q and k per head
        if hasattr(attn, name):
            out[f"self_attn.{name}.weight"] = getattr(attn, name).weight
    return out


def tie_to_sglang(hf_model, sglang_model, source_layers, views: LayerViews) -> None:
    """Make the HF model's layers at `source_layers` and its final norm SGLang's tensors.
    Raises ValueError where a shape differs (a quantised or repacked SGLang weight): the
    drafter then cannot share the target's layers."""
    for i in source_layers:
        mine = dict(hf_model.model.layers[i].named_parameters())
        for name, t in split_views(sglang_layer(sglang_model, i), views).items():
            _assign(hf_model.model.layers[i], name, t, mine.get(name))
    norm = sglang_model.model.norm.weight
    _assign(hf_model.model, "norm.weight", norm, hf_model.model.norm.weight)


def _assign(module, name: str, t: torch.Tensor, expected) -> None:
    if expected is None or tuple(expected.shape) != tuple(t.shape) or not t.is_floating_point():
        want = None if expected is None else tuple(expected.shape)
        raise ValueError(f"SGLang's {name} is {t.dtype} {tuple(t.shape)}, the drafter needs a "
                         f"plain float tensor of shape {want}")
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, leaf, torch.nn.Parameter(t, requires_grad=False))


class PoolPrefix:
    """Per layer, each row's committed keys and values from SGLang's KV pool, padded to the
    longest row: (k, v) [N, Hkv, P, D]. Gathered lazily, one layer at a time."""

    def __init__(self, kv_pool, slots: torch.Tensor, dtype: torch.dtype) -> None:
        self.pool = kv_pool
        self.slots = slots  # [N, P] KV-pool slot of each prefix position (padding: any slot)
        self.dtype = dtype

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.pool.get_key_buffer(layer)[self.slots]  # [N, P, Hkv, D]
        v = self.pool.get_value_buffer(layer)[self.slots]
        return (k.to(self.dtype).transpose(1, 2), v.to(self.dtype).transpose(1, 2))


def block_mask(lens: torch.Tensor, prefix: int, block: int) -> torch.Tensor:
    """lens [N] committed lengths, `prefix` = max(lens) -> [N, B, P + B] bool: row i's
    block sees its own lens[i] prefix entries; the anchor (block position 0) sees itself, the
    masks see the whole block."""
    n, dev = lens.shape[0], lens.device
    pre = torch.arange(prefix, device=dev)[None, :] < lens[:, None]  # [N, P]
    inner = torch.ones(block, block, dtype=torch.bool, device=dev)
    inner[0, 1:] = False  # the anchor is causal
    return torch.cat([pre[:, None, :].expand(n, block, prefix),
                      inner[None].expand(n, block, block)], 2)


def prefix_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 prefix: int) -> torch.Tensor:
    """-> [N, P] KV-pool slots of positions 0 .. P-1 of each request (beyond a row's own
    length: whatever the table holds there; the mask hides it)."""
    cols = torch.arange(prefix, device=req_to_token.device)
    return req_to_token[req_pool_indices.to(torch.int64)[:, None], cols[None, :]].to(torch.int64)


# The most bytes one draft pass gathers from the KV pool for one layer (K and V, before and
# after the cast and transpose): rows beyond it go in further passes (memory.py counts it).
GATHER_BYTES = 512 << 20


def gather_bytes_per_token(drafter: D3DDrafter, pool_dtype_bytes: int) -> int:
    """Bytes one prefix position of one row costs in a layer's gather (PoolPrefix)."""
    a = drafter.arch
    return 2 * a.num_kv_heads * a.head_dim * (pool_dtype_bytes + drafter.mask_embedding.element_size())


def rows_per_pass(max_len: int, per_token: int, budget: int = GATHER_BYTES) -> int:
    """How many rows of a batch one draft pass takes, so its prefix gather stays in `budget`."""
    return max(1, budget // max(1, max_len * per_token))


class PoolDrafter:
    """Draft passes of a full-depth drafter tied to SGLang's target (see module doc)."""

    def __init__(self, drafter: D3DDrafter, kv_pool, req_to_token: torch.Tensor,
                 block: int, fused=None) -> None:
        """fused: shared_layers.fused_layers over SGLang's model (its fused projections as
        they are), else the drafter's own modules (row-slice views of the same tensors)."""
        self.drafter = drafter
        self.fused = fused
        self.pool = kv_pool
        self.req_to_token = req_to_token
        self.block = block
        self.pack = drafter.cfg.pack_block(block)  # drafted at a trained size at least
        self.per_token = gather_bytes_per_token(drafter, kv_pool.get_key_buffer(0).element_size())
        self.passes = 0

    def draft(self, last: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
              max_len: int) -> torch.Tensor:
        """last [N] x_last, lens [N] committed KV lengths (device), max_len = max(lens) (host,
        from SGLang's seq_lens_cpu: no sync) -> drafts [N, block-1] (greedy, on device). One
        pass for the batch where its prefix gather fits GATHER_BYTES, else row groups."""
        step = rows_per_pass(max_len, self.per_token)
        if step >= last.shape[0]:
            return self._pass(last, req_pool_indices, lens, max_len)
        return torch.cat([self._pass(last[i : i + step], req_pool_indices[i : i + step],
                                     lens[i : i + step], max_len)
                          for i in range(0, last.shape[0], step)])

    @torch.inference_mode()
    def _pass(self, last: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
              max_len: int) -> torch.Tensor:
        self.passes += 1
        d, b = self.drafter, self.pack
        n, dev = last.shape[0], last.device
        ids = torch.full((n, b), MASK_ID, dtype=torch.int64, device=dev)
        ids[:, 0] = last
        positions = lens.to(torch.int64)[:, None] + torch.arange(b, device=dev)  # [N, B]
        mask = block_mask(lens.to(torch.int64), max_len, b)
        past = PoolPrefix(self.pool, prefix_slots(self.req_to_token, req_pool_indices, max_len),
                          d.mask_embedding.dtype)
        self._gate(n, b, dev)
        batch = Batch(positions, mask, past=past)
        try:
            if self.fused is not None:
                h = run_fused(self.fused, d, d.embed(ids), batch)
            else:
                h = run_layers(d.layers, d._shared["rot"], d.embed(ids), batch, d.arch)
        finally:
            d.gate.clear()
        h = d._shared["norm"](h[:, : self.block - 1])  # [N, block-1, H]
        return d.logits(h).argmax(-1)  # [N, block-1]

    def _gate(self, n: int, b: int, dev) -> None:
        """The deltas' switch (models/adapters.Gate) without the host syncs `Gate.set` does:
        block position 0 is clean, the rest are masks, known here."""
        g = self.drafter.gate
        is_mask = torch.ones(n, b, 1, dtype=self.drafter.mask_embedding.dtype, device=dev)
        is_mask[:, 0] = 0
        g.clear()
        g.value = is_mask
        g.rows = torch.tensor([i * b + j for i in range(n) for j in range(1, b)], device=dev)
        g.span = (1, b) if n == 1 else None


def own_bytes(drafter: D3DDrafter) -> int:
    """The bytes the drafter holds of its own: deltas and mask embedding."""
    return sum(t.numel() * t.element_size() for t in drafter.own_state().values())
