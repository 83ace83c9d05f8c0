"""Random-weight models in the shapes of real ones, for gpu_scale.py (nothing is downloaded).

The shapes are the public configs' sizes (hidden, MLP, layers, heads, vocabulary); the weights
are random, so only timings mean anything. `tiny` keeps each family's structure at toy sizes,
so the whole check runs on a CPU in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter

BLOCK = 16  # the drafter's block: 15 drafts + a guess of the bonus token


@dataclass(frozen=True)
class Shape:
    name: str
    family: str  # "llama" | "qwen3"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def tiny(self) -> Shape:
        """Same family, head grouping and tying, at toy sizes."""
        heads = 2 * (self.heads // self.kv_heads)
        return Shape(
            f"{self.name} (tiny)", self.family, 16 * heads, 128, 2, heads, 2, 16, 128, self.tied
        )


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", "llama", 576, 1536, 30, 9, 3, 64, 49152, True),
    "qwen3-1.7b": Shape("Qwen3-1.7B", "qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": Shape("Qwen3-8B", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False),
    # 64 GB of bf16 weights, twice with a full-depth drafter: opt in with --shapes
    "qwen3-32b": Shape("Qwen3-32B", "qwen3", 5120, 25600, 64, 64, 8, 128, 151936, False),
}
DEFAULT_SHAPES = ("smollm2-135m", "qwen3-1.7b", "qwen3-8b")


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype) -> Decoder:
    """A random-weight target, created directly on `device` in `dtype` (no CPU copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        tie_word_embeddings=shape.tied,
    )
    cls, cfg = (
        (Qwen3ForCausalLM, Qwen3Config(**common))
        if shape.family == "qwen3"
        else (LlamaForCausalLM, LlamaConfig(**common))
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return Decoder.from_hf(model.eval())


def build_drafter(target: Decoder) -> D3DDrafter:
    """The drafter for a shape as the recipe ships it: every target layer (shared) plus rank-32
    deltas on mask slots, trained on blocks of 4..BLOCK. The one place it is constructed."""
    return D3DDrafter.init_from_target(target, None, BLOCK, rank=32, min_block=4).eval()
