"""A llama-family GGUF's Q4_1 projection weights as `Q4Blocks`, per HF layer and projection.

Read with the `gguf` package's reader, bytes as stored: a Q4_1 block is 20 bytes (fp16 d,
fp16 m, then 16 bytes whose low nibbles are inputs 0-15 of the block and high nibbles inputs
16-31, ggml's `block_q4_1`). llama.cpp's converter permutes the rows of q and k (its RoPE pairs
adjacent dimensions, HF's pairs halves); the rows are put back in HF's order here, as
transformers does when it dequantises the same file, so these weights line up with the HF
model's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sglang_d3d.models.q4_linear import GROUP, Q4Blocks

BLOCK_BYTES = 4 + GROUP // 2  # fp16 d, fp16 m, 32 nibbles
# GGUF tensor name in layer i -> (HF submodule, projection)
PROJECTIONS = {
    "attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"), "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"), "ffn_down": ("mlp", "down_proj"),
}


def q4_1_blocks(raw: np.ndarray) -> Q4Blocks:
    """raw [N, G * 20] uint8 (one row of Q4_1 blocks per output) -> Q4Blocks of [N, G * 32]."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES)  # [N, G, 20]
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # [N, G]
    m = b[..., 2:4].copy().view(np.float16)[..., 0]
    nib = b[..., 4:]  # [N, G, 16]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, -1)  # [N, G * 32]
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """[rows] source row of each HF row, undoing llama.cpp's q/k permutation (per head, the
    two RoPE halves interleaved)."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)


def read_q4_layers(path: Path, num_heads: int, num_kv_heads: int) -> list[dict[str, Q4Blocks]]:
    """Per layer, HF projection name ('q_proj', ...) -> its weight as Q4Blocks. Raises
    ValueError where a projection is not stored as Q4_1 (another quantisation)."""
    from gguf import GGMLQuantizationType, GGUFReader

    layers: dict[int, dict[str, Q4Blocks]] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in PROJECTIONS:
            continue
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            raise ValueError(f"{path.name}: {t.name} is {t.tensor_type.name}, not Q4_1")
        blocks = q4_1_blocks(np.asarray(t.data))
        proj = PROJECTIONS[parts[2]][1]
        if proj in ("q_proj", "k_proj"):
            heads = num_heads if proj == "q_proj" else num_kv_heads
            blocks = blocks.rows(unpermute_index(blocks.shape[0], heads))
        layers.setdefault(int(parts[1]), {})[proj] = blocks
    out = [layers[i] for i in sorted(layers)]
    if not out or any(len(layer) != len(PROJECTIONS) for layer in out):
        raise ValueError(f"{path.name}: no complete set of Q4_1 projections per layer")
    return out


def permute_for_gguf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `unpermute_index`: HF rows -> llama.cpp's order (what its converter
    writes; tests build GGUF files with it)."""
    idx = unpermute_index(w.shape[0], num_heads)
    out = torch.empty_like(w)
    out[idx] = w
    return out


Q8_BLOCK_BYTES = 2 + GROUP  # fp16 d, 32 int8


def read_q8_head(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LM head as Q8_0 (q [V, H] int8, d [V, H / 32] fp16): `output.weight`, or the tied
    embedding where there is none; None where it is stored otherwise."""
    from gguf import GGMLQuantizationType, GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if t is None or t.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    raw = np.asarray(t.data)
    b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, Q8_BLOCK_BYTES)  # [V, G, 34]
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # [V, G]
    q = b[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)  # [V, G * 32]
    return torch.from_numpy(q), torch.from_numpy(d)
