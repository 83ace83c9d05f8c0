"""The verify pass as SGLang sees it: which tokens, at which positions, written to which KV slots,
and what the scheduler gets back.

Per request with committed KV length L (the prompt and every accepted token except the newest,
whose KV the next verify writes), the block is

    tokens    [x_last, d1 .. d_{B-1}]
    positions  L, L+1 .. L+B-1
    KV slots   req_to_token[req, L : L+B]   (reserved by SGLang's spec decode allocation)

After verification with n drafts accepted and target token t, the committed length becomes
L + n + 1 (x_last and d1..dn keep their KV; the rest is scratch that the next block overwrites)
and the scheduler receives the run [d1 .. dn, t].
"""

from __future__ import annotations

import torch


def block_positions(seq_lens: torch.Tensor, block: int) -> torch.Tensor:
    """seq_lens [bs] -> positions [bs * block]."""
    offsets = torch.arange(block, device=seq_lens.device, dtype=torch.int64)
    return (seq_lens.to(torch.int64)[:, None] + offsets).reshape(-1)


def block_cache_loc(
    req_to_token: torch.Tensor,  # [pool_rows, max_context] KV slot of each request position
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] committed lengths
    block: int,
) -> torch.Tensor:
    """-> KV slots [bs * block] that the verify pass writes (already reserved by SGLang)."""
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(block, device=seq_lens.device)
    rows = req_pool_indices.to(torch.int64)[:, None].expand_as(cols)
    return req_to_token[rows, cols].to(torch.int64).reshape(-1)


def commit_rows(
    runs: list[list[int]],  # per request: accepted drafts + the target's token
    seq_lens: torch.Tensor,  # [bs] committed lengths before the verify
    block: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out_tokens [bs * block] padded rows, accept_lens [bs] int32, new_seq_lens [bs]).

    SGLang reads row i of out_tokens up to accept_lens[i] (stride = block)."""
    out = torch.zeros(len(runs), block, dtype=torch.int64)
    for i, run in enumerate(runs):
        out[i, : len(run)] = torch.tensor(run, dtype=torch.int64)
    lens = torch.tensor([len(r) for r in runs], dtype=torch.int32)
    new_lens = seq_lens + lens.to(device=seq_lens.device, dtype=seq_lens.dtype)
    return out.reshape(-1).to(device), lens.to(device), new_lens


def build_verify_forward_batch(batch, target_worker, tokens: torch.Tensor, block: int,
                               positions: torch.Tensor | None = None,
                               cache_loc: torch.Tensor | None = None):
    """Turn the decode ScheduleBatch into SGLang's TARGET_VERIFY ForwardBatch for `tokens`
    [bs, block]. -> (forward_batch, can_run_cuda_graph). Mutates `batch` the way SGLang's own
    linear-block verifier (DFlash) does; the scheduler runs us inside its forward isolation,
    which restores the batch afterwards. Attention metadata is left to the model runner's
    forward, which plans it once (`defer_metadata_init`: planning here too would plan twice).
    `positions` [bs * block] and `cache_loc` [bs * block]: a fused forward's own (fused_cycle.py);
    default, a chain's."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    runner = target_worker.model_runner
    seq_lens = batch.seq_lens
    if positions is None:
        positions = block_positions(seq_lens, block)
    batch.out_cache_loc = cache_loc if cache_loc is not None else block_cache_loc(
        runner.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, block
    )
    verify = DFlashVerifyInput(
        draft_token=tokens.reshape(-1).to(seq_lens.device),
        positions=positions,
        draft_token_num=block,
        custom_mask=None,  # a chain: the backend's causal mask is the verify mask
        capture_hidden_mode=CaptureHiddenMode.NULL,  # D3D never reads target hidden states
    )
    saved = batch.seq_lens_cpu, batch.seq_lens_sum
    if batch.seq_lens_cpu is not None:
        # Host-side bound for the backends' planning: committed prefix + one block.
        batch.seq_lens_cpu = batch.seq_lens_cpu + block
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    fb, can_graph = verify.prepare_for_verify(batch, target_worker, defer_metadata_init=True)
    batch.seq_lens_cpu, batch.seq_lens_sum = saved
    if is_torch_native(runner.attn_backend):
        committed = saved[0].tolist() if saved[0] is not None else seq_lens.tolist()
        _as_extend_for_torch_native(fb, seq_lens, block, committed)
    return fb, can_graph


def is_torch_native(backend) -> bool:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return isinstance(backend, TorchNativeAttnBackend)


def _as_extend_for_torch_native(fb, seq_lens: torch.Tensor, block: int,
                                committed: list[int]) -> None:
    """torch_native has no TARGET_VERIFY path: it runs every non-decode mode through its
    extend kernel, which reads extend_prefix_lens / extend_seq_lens and wants seq_lens to
    include the new tokens. A causal extend of `block` tokens on the committed prefix is
    exactly the verify pass of a chain."""
    bs = seq_lens.shape[0]
    fb.extend_prefix_lens = seq_lens.to(torch.int32)
    fb.extend_seq_lens = torch.full((bs,), block, dtype=torch.int32, device=seq_lens.device)
    fb.seq_lens = seq_lens + block
    fb.extend_prefix_lens_cpu = committed  # host values: SGLang's seq_lens_cpu
    fb.extend_seq_lens_cpu = [block] * bs
