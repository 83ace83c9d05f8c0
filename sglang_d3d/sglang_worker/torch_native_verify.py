"""A verify path for SGLang's torch_native attention backend (CPU).

torch_native has no TARGET_VERIFY path: it runs every non-decode batch through its extend
kernel, which for each request and layer builds a query as long as the request's whole context
and attends causally over all of it, keeping only the last rows: O(context^2) work for a block
of a few tokens. `install(backend)` gives the backend's `forward_extend` a verify branch that
attends only the block's queries: one masked attention for the whole batch per layer, the key
indices and mask built once per forward (the batch's attention metadata) and kept on it.
Other batches (SGLang's own prefill) run SGLang's kernel unchanged.

A fused forward (fused_cycle.py) carries its rows' layout (`FUSED`, fused_layout.BatchLayout)
on its verify input: its verify rows attend exactly as a plain verify's do (the same keys, mask and call), and its
mask rows attend the pool's prefix and verify keys plus their own fresh keys, which never reach
the pool (their KV slot is SGLang's padding slot).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_d3d.sglang_worker.fused_layout import mask_row_mask

ATTR = "_d3d_verify_plan"
# A fused forward's layout, set on its verify input (ForwardBatch.spec_info: the model runner
# plans metadata on its own copy of the ForwardBatch, which shares the verify input).
FUSED = "_d3d_fused_layout"


def verify_plan(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                prefix_lens: torch.Tensor, block: int, longest: int):
    """-> (key slots [N, longest + block], mask [N, 1, block, longest + block]): row i's
    block token t sees positions 0 .. prefix_i + t (its prefix, and the block up to itself)."""
    span = longest + block
    cols = torch.arange(span, device=req_to_token.device)
    slots = req_to_token[req_pool_indices.to(torch.int64)[:, None], cols[None, :]].to(torch.int64)
    last = prefix_lens.to(torch.int64)[:, None] + torch.arange(block, device=cols.device)  # [N, B]
    mask = cols[None, None, :] <= last[:, :, None]  # [N, B, span]
    return slots, mask[:, None]


def install(backend) -> None:
    """Give a TorchNativeAttnBackend the verify branch: its metadata plan builds the verify
    plan, its `forward_extend` uses it."""
    if getattr(backend, "_d3d_verify_installed", False):
        return
    inner = backend.forward_extend
    inner_plan = backend.init_forward_metadata

    def init_forward_metadata(fb):
        inner_plan(fb)
        if fb.forward_mode.is_target_verify() and fb.extend_prefix_lens_cpu is not None:
            layout = getattr(getattr(fb, "spec_info", None), FUSED, None)
            block = fb.extend_seq_lens_cpu[0] if layout is None else layout.width
            slots, mask = verify_plan(backend.req_to_token_pool.req_to_token,
                                      fb.req_pool_indices, fb.extend_prefix_lens, block,
                                      max(fb.extend_prefix_lens_cpu))
            masks = (None if layout is None
                     else mask_row_mask(layout, fb.extend_prefix_lens, slots.shape[1]))
            setattr(fb, ATTR, (slots, mask, masks))

    def forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True):
        if not _plain_verify(layer, forward_batch):
            return inner(q, k, v, layer, forward_batch, save_kv_cache)
        return _verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache)

    backend.forward_extend = forward_extend
    backend.init_forward_metadata = init_forward_metadata
    backend._d3d_verify_installed = True


def _plain_verify(layer, fb) -> bool:
    window = getattr(layer, "sliding_window_size", None)
    return (fb.forward_mode.is_target_verify() and not layer.is_cross_attention
            and (window is None or window < 0) and getattr(fb, ATTR, None) is not None)


def _verify_attention(backend, q, k, v, layer, fb, save_kv_cache):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, backend.swa_out_cache_loc), k, v)
    slots, mask, masks = getattr(fb, ATTR)
    n, block = slots.shape[0], mask.shape[2]
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    t = q.shape[0] // n  # block, or block + the mask rows of a fused forward
    if t != block and masks is None:
        raise RuntimeError(f"a verify of {t} rows a request planned for {block}: a fused "
                           "forward's layout did not reach the attention plan")
    query = q.view(n, t, hq, d).transpose(1, 2)  # [N, Hq, T, D]
    keys = pool.get_key_buffer(layer.layer_id)[slots].transpose(1, 2)  # [N, Hkv, S, D]
    values = pool.get_value_buffer(layer.layer_id)[slots].transpose(1, 2)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    gqa = hq != layer.tp_k_head_num
    out = scaled_dot_product_attention(query[:, :, :block], keys, values, attn_mask=mask,
                                       scale=layer.scaling, enable_gqa=gqa)  # [N, Hq, B, Dv]
    if masks is not None:
        hkv = layer.tp_k_head_num
        own_k = k.reshape(n, t, hkv, -1)[:, block:].transpose(1, 2).to(query.dtype)
        own_v = v.reshape(n, t, hkv, -1)[:, block:].transpose(1, 2).to(query.dtype)
        rest = scaled_dot_product_attention(query[:, :, block:], torch.cat([keys, own_k], 2),
                                            torch.cat([values, own_v], 2), attn_mask=masks,
                                            scale=layer.scaling, enable_gqa=gqa)
        out = torch.cat([out, rest], 2)  # [N, Hq, T, Dv]
    return out.transpose(1, 2).reshape(n * t, hq * layer.v_head_dim)
