"""The drafter's two training passes over a collated batch (training/objective.py).

clean pass: the sequence, causal, no gradient -> each layer's keys/values and final hidden.
block pass: the mask slots over those frozen keys/values, with gradient -> slot hidden states.
The teacher is the target's distribution at the slot's clean position; at full depth the
drafter's clean pass is the target, so the teacher costs nothing extra.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from sglang_d3d.models.decoder import Batch, run_layers
from sglang_d3d.models.drafter import MASK_ID


@torch.no_grad()
def clean_pass(drafter, batch: dict) -> tuple[list, torch.Tensor]:
    """-> per-layer (k, v) [N, Hkv, T, D] and final-normed hidden [N, T, H]."""
    record: list = []
    h = drafter.hidden(batch["ids"], batch["clean_pos"], batch["clean_mask"], record=record)
    return record, h


def block_hidden(drafter, batch: dict, past: list) -> torch.Tensor:
    """-> [N, KM, H] final-normed hidden states of the mask slots."""
    ids = torch.full_like(batch["slot_pos"], MASK_ID)
    return drafter.hidden(ids, batch["slot_pos"], batch["slot_mask"], past=past)


@torch.no_grad()
def target_hidden(target, batch: dict) -> torch.Tensor:
    """The target's final-normed hidden [N, T, H] over the clean sequence."""
    b = Batch(batch["clean_pos"], batch["clean_mask"])
    h = run_layers(target.layers, target.rotary, target.embed_tokens(batch["ids"]), b, target.arch)
    return target.norm(h)


def teacher_source(drafter, target, batch: dict, clean_h: torch.Tensor) -> torch.Tensor:
    """[N, T, H] hidden states whose LM-head outputs are the teacher's distributions."""
    return clean_h if drafter.is_full_depth else target_hidden(target, batch)


def pick_rows(h: torch.Tensor, index: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """h [N, L, H], index [N, K] into L, sel [N, K] bool -> [M, H] rows h[n, index[n, k]]."""
    rows = torch.arange(h.shape[0], device=index.device).unsqueeze(1).expand_as(index)
    return h[rows[sel], index[sel]]


def checkpoint_mlps(drafter) -> None:
    """Gradient checkpointing: each drafter layer's MLP (its activations, three of the
    intermediate width per token, are the largest a layer keeps for the backward pass) is
    recomputed in the backward pass instead of stored. The deltas read the drafter's Gate,
    which is cleared once a forward ends, so each recomputation runs with the Gate as its
    forward saw it. The drafter's MLP modules are its own shallow copies: the target's are
    untouched."""
    gate = drafter.gate
    for layer in drafter.layers:
        layer.mlp.forward = _recomputed(layer.mlp.forward, gate)


def _recomputed(forward, gate):
    def run(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return forward(x)
        seen = (gate.value, gate.rows, gate.span)

        def again(inp: torch.Tensor) -> torch.Tensor:
            now = (gate.value, gate.rows, gate.span)
            gate.value, gate.rows, gate.span = seen
            try:
                return forward(inp)
            finally:
                gate.value, gate.rows, gate.span = now

        return checkpoint(again, x, use_reentrant=False)

    return run
