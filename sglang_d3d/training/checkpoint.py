"""Training checkpoints: an engine-loadable drafter folder plus the trainer's own state.

  <out>/drafter/            config.json + model.safetensors (bf16, D3DDrafter.save_pretrained)
  <out>/trainer_state.pt    fp32 weights, optimizer, step, RNG, eval history (resume only)

Both are written to a temporary path and renamed, so an interrupted save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

STATE = "trainer_state.pt"
DRAFTER = "drafter"


def save_drafter_atomic(drafter, folder: Path) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(out: Path, drafter, optimizer, step: int, gen: torch.Generator, extra: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_drafter_atomic(drafter, out / DRAFTER)
    state = {
        "model": drafter.state_dict(),
        "head_ids": drafter.head_ids,
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": gen.get_state(),
        **extra,
    }
    tmp = out / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / STATE)


def load_state(out: Path) -> dict | None:
    path = out / STATE
    return torch.load(path, weights_only=False) if path.exists() else None
