"""A verify path for SGLang's torch_native attention backend (CPU).

torch_native has no TARGET_VERIFY path: it runs every non-decode batch through its extend
kernel, which for each request and layer builds a query as long as the request's whole context
and attends causally over all of it, keeping only the last rows: O(context^2) work for a block
of a few tokens. `install(backend)` gives the backend's `forward_extend` a verify branch that
attends only the block's queries: one masked attention for the whole batch per layer, the key
indices and mask built once per forward (the batch's attention metadata) and kept on it.
Other batches (SGLang's own prefill) run SGLang's kernel unchanged.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

ATTR = "_d3d_verify_plan"


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
            block = fb.extend_seq_lens_cpu[0]
            setattr(fb, ATTR, verify_plan(backend.req_to_token_pool.req_to_token,
                                          fb.req_pool_indices, fb.extend_prefix_lens, block,
                                          max(fb.extend_prefix_lens_cpu)))

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
    slots, mask = getattr(fb, ATTR)
    n, block = slots.shape[0], mask.shape[2]
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    query = q.view(n, block, hq, d).transpose(1, 2)  # [N, Hq, B, D]
    keys = pool.get_key_buffer(layer.layer_id)[slots].transpose(1, 2)  # [N, Hkv, S, D]
    values = pool.get_value_buffer(layer.layer_id)[slots].transpose(1, 2)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    out = scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=layer.scaling,
                                       enable_gqa=hq != layer.tp_k_head_num)
    return out.transpose(1, 2).reshape(n * block, hq * layer.v_head_dim)
