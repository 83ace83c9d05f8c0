"""Training checkpoints: an engine-loadable drafter folder plus the trainer's own state.

  <out>/drafter/            config.json + model.safetensors (bf16, D3DDrafter.save_pretrained),
                            acceptance.json (held-out rates), README.md (model_card.py)
  <out>/trainer_state.pt    fp32 deltas, optimizer, step, RNG, data position, history (resume)
  <out>/trainer_meta.json   step, RNG, data position, history: with drafter/ it is the small
                            resume point a repository can keep (trainer_state.pt is too big
                            for one); resuming from it restarts only Adam's moments

Both are written to a temporary path and renamed, so an interrupted save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from sglang_d3d.models.acceptance import ACCEPTANCE, write_acceptance
from sglang_d3d.training.model_card import CARD

STATE = "trainer_state.pt"
META = "trainer_meta.json"
DRAFTER = "drafter"


def readable_files(folder: Path) -> None:
    """Give the folder's files the mode a new file gets under the umask (0644 under 022):
    safetensors writes its files 0600, so a drafter written by one user could not be served by
    another (a service account, a container)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def save_drafter_atomic(drafter, folder: Path, eval_row: dict | None = None,
                        card: str | None = None) -> None:
    """eval_row: the latest held-out evaluation, kept beside the weights (acceptance.json);
    card: the folder's README.md (model_card.py)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    if eval_row is not None:
        write_acceptance(tmp, eval_row)
    if card is not None:
        (tmp / CARD).write_text(card)
    readable_files(tmp)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def latest_eval(history: list[dict]) -> dict | None:
    evals = [r for r in history if "by_position" in r]
    return evals[-1] if evals else None


def save_checkpoint(out: Path, drafter, optimizer, step: int, gen: torch.Generator, extra: dict,
                    card: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_drafter_atomic(drafter, out / DRAFTER, latest_eval(extra.get("history", [])), card)
    state = {
        "model": {k: v.detach().clone() for k, v in drafter.own_state().items()},
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": gen.get_state(),
        **extra,
    }
    tmp = out / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / STATE)
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}
    meta["rng"] = state["rng"].tolist()
    (out / (META + ".tmp")).write_text(json.dumps(meta) + "\n")
    os.replace(out / (META + ".tmp"), out / META)


def load_state(out: Path) -> dict | None:
    """The full state if present, else the committed meta (no optimizer, weights from
    drafter/), else None."""
    path = out / STATE
    if path.exists():
        # on the CPU: every rank reads it, and the trainer copies it onto its own device
        return torch.load(path, map_location="cpu", weights_only=False)
    if (out / META).exists() and (out / DRAFTER).exists():
        from safetensors.torch import load_file

        meta = json.loads((out / META).read_text())
        meta["rng"] = torch.tensor(meta["rng"], dtype=torch.uint8)
        meta["model"] = load_file(str(out / DRAFTER / "model.safetensors"))
        return meta
    return None


def export(src: Path, dst: Path, card: str | None = None) -> None:
    """Copy a drafter folder; card: its README.md rewritten for the new path (else copied)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / name, dst / name)
    for name in (ACCEPTANCE, CARD):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if card is not None:
        (dst / CARD).write_text(card)
