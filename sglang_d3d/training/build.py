"""Loading the frozen target and building or loading the drafter for training and pruning."""

from __future__ import annotations

import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter


def load_target(path: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Decoder:
    """The target's decoder with every weight frozen (only the drafter's deltas train)."""
    from sglang_d3d.models.loading import load_hf_model, resolve_target_path

    hf = load_hf_model(resolve_target_path(path), str(dtype).removeprefix("torch.")).to(device)
    hf.requires_grad_(False)
    return Decoder.from_hf(hf)


def build_drafter(target: Decoder, init_from: str | None, layers: tuple[int, ...] | None,
                  block: int, rank: int = 32, alpha: float = 32.0, seed: int = 0,
                  min_block: int = 0) -> D3DDrafter:
    """From a checkpoint, or fresh over `layers` of the target (None: all of them)."""
    if init_from:
        drafter = D3DDrafter.from_pretrained(init_from, target)
    else:
        drafter = D3DDrafter.init_from_target(target, layers, block, rank, alpha, seed,
                                              min_block)
    for p in drafter.trainable_parameters():
        p.requires_grad_(True)
    return drafter.train()


def parse_layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())
