"""A tiny random target + D3D drafter pair that SGLang itself can load (built in seconds).

Like sglang_d3d.testing.make_tiny_pair, but with an untied LM head: with tied embeddings a
random model's greedy output mostly repeats its last input token, and a test of "speculation
gives the same tokens" would then hardly test anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_d3d.sglang_worker.drafter_loading import mark_for_sglang

VOCAB = 96


def make_pair(root: str | Path, block_size: int = 4, seed: int = 0,
              full_depth: bool = False) -> tuple[str, str]:
    """-> (target_dir, drafter_dir); the drafter config is marked for SGLang. `full_depth`:
    the drafter runs every target layer (and shares SGLang's target); else layers 0 and 3.
    A full-depth drafter gets random deltas, so its drafts differ from the target's."""
    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.testing import tiny_hf_model, tiny_tokenizer

    root = Path(root)
    target_dir, drafter_dir = root / "target", root / "drafter"
    model = tiny_hf_model("llama", seed=seed, vocab=VOCAB, tied=False)  # sharp logits, untied
    model.save_pretrained(target_dir)
    tiny_tokenizer(VOCAB).save_pretrained(target_dir)
    layers = None if full_depth else [0, 3]
    drafter = D3DDrafter.init_from_target(Decoder.from_hf(model), layers, block_size)
    if full_depth:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # fresh deltas are zero: the drafts would be the target's
            for p in drafter.trainable_parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    drafter.save_pretrained(drafter_dir, dtype=torch.float32)
    mark_for_sglang(drafter_dir, target_dir)
    return str(target_dir), str(drafter_dir)
