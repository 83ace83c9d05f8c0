"""Loading the frozen target and building or loading the drafter for training and pruning."""

from __future__ import annotations

import contextlib

import torch

from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter


def load_target(path: str | None) -> Decoder:
    """The target's decoder with every weight frozen (only the drafter's own weights train)."""
    from sglang_d3d.models.loading import load_hf_model, resolve_target_path

    hf = load_hf_model(resolve_target_path(path))
    hf.requires_grad_(False)
    return Decoder.from_hf(hf)


def build_drafter(target: Decoder, init_from: str | None, layers: list[int], block: int) -> D3DDrafter:
    if init_from:
        drafter = D3DDrafter.from_pretrained(init_from, target)
    else:
        # The objective (objective.py) trains the "masks" layout: B mask slots after the anchor.
        drafter = D3DDrafter.init_from_target(target, layers, block, block_layout="masks")
    for p in drafter.parameters():
        p.requires_grad_(True)  # the copied target layers arrive frozen
    return drafter.train()


def parse_layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def autocast(enabled: bool):
    """bf16 autocast on CPU: matmuls use AMX/AVX-512 bf16, master weights stay fp32."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)
