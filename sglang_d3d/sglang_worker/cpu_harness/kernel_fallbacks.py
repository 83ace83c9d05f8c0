"""Replacements for the sgl_kernel ops that sglang 0.5.23 calls on the CPU paths we run.

Found by running SGLang's scheduler and model runner on CPU (torch_native attention, tiny Llama)
with every sgl_kernel name served by a placeholder that records calls (shims.CALLED): the
non-speculative path calls none; a speculative algorithm calls the two below:

- copy_all_layer_kv_cache_cpu: KV pool set-up (memory_pool._init_kv_copy_and_warmup ->
  kernels/ops/kvcache/cache_move.copy_all_layer_kv_cache_func)
- assign_req_to_token_pool_cpu: KV reservation for each decode step
  (speculative/eagle_utils.eagle_prepare_for_decode -> mem_cache/allocation.alloc_for_spec_decode
  -> assign_req_to_token_pool_func)
"""

from __future__ import annotations

import ctypes

import torch

from sglang_d3d.sglang_worker.cpu_harness.shims import PlaceholderModule


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [num_buffers] int64 base address of each layer's K or V buffer
    strides: torch.Tensor,  # [num_buffers] bytes per KV slot (row) of each buffer
    tgt_loc: torch.Tensor,  # [n] destination slots
    src_loc: torch.Tensor,  # [n] source slots
) -> None:
    """Copy KV slot src_loc[i] to tgt_loc[i] in every buffer. The kernel takes raw addresses
    (it serves any layout), so the copy is a memmove per slot: slow, and only for tests."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [pool_rows, pool_len]
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] new KV slots, request after request
    pool_len: int,
) -> None:
    """req_to_token[req_i, start_i:end_i] = the next (end_i - start_i) slots of out_cache_loc."""
    at = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


FALLBACKS: dict[str, object] = {
    "sgl_kernel.copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "sgl_kernel.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
}


def install() -> None:
    PlaceholderModule.overrides.update(FALLBACKS)
