"""Write a trained drafter in a compact delta store (int8 or int4) for shipping.

    d3d compact --src runs/mine --dst sglang_d3d/assets/drafter --store int4
    d3d compact --src runs/mine --dst runs/mine_rank16 --store int4 --rank 16

`--rank K` also cuts every delta to its K largest singular directions (models/delta_rank.py):
a checkpoint about K/r the size, whose cost in accepted length is measured, not assumed.

`--src` is a `d3d train` output folder (its fp32 deltas in trainer_state.pt are quantised
where present, else the drafter/ folder's) or a drafter folder. No target is loaded: the
deltas are quantised as stored (models/delta_store.py). The destination keeps files it already
has (the corpus, corpus.npz); the held-out acceptance record comes along.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from sglang_d3d.models.acceptance import ACCEPTANCE
from sglang_d3d.models.delta_rank import truncate_state
from sglang_d3d.models.delta_store import FLOAT, STORES
from sglang_d3d.models.drafter import DrafterFormatError, read_config, write_checkpoint
from sglang_d3d.training.checkpoint import DRAFTER, STATE, readable_files


def add_compact_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="a `d3d train` output folder or a drafter folder")
    p.add_argument("--dst", required=True, help="the drafter folder to write")
    p.add_argument("--store", default="int4", choices=sorted(STORES),
                   help="int4 (5.5 MB at full depth), int8 (9.8 MB) or float (bf16, 19.6 MB)")
    p.add_argument("--rank", type=int, default=None,
                   help="cut the deltas to this rank (their K largest singular directions); "
                   "default: keep the trained rank")


def source_state(src: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(drafter folder, its own state at the best precision at hand)."""
    folder = src / DRAFTER if (src / DRAFTER / "config.json").exists() else src
    if not (folder / "config.json").exists():
        raise DrafterFormatError(f"{src} holds no drafter (no config.json in it or in its "
                                 f"{DRAFTER}/)")
    cfg = read_config(folder)
    if cfg.delta_store != FLOAT:
        raise DrafterFormatError(f"{folder} is stored as {cfg.delta_store} already; compact "
                                 "from the training folder or a float checkpoint")
    if (src / STATE).exists():
        return folder, torch.load(src / STATE, weights_only=False)["model"]
    return folder, load_file(str(folder / "model.safetensors"))


def compact(src: Path, dst: Path, store: str, rank: int | None = None) -> dict:
    folder, state = source_state(src)
    cfg = read_config(folder)
    out = {"store": store, "rank": cfg.adapter_rank}
    if rank is not None:
        if not 1 <= rank <= cfg.adapter_rank:
            raise DrafterFormatError(f"--rank {rank}: must be 1 to the deltas' rank "
                                     f"{cfg.adapter_rank}")
        state, kept = truncate_state(state, cfg.adapter_rank, cfg.adapter_alpha, rank)
        cfg = replace(cfg, adapter_rank=rank)
        out |= {"rank": rank, "energy_kept": round(kept, 6)}
    write_checkpoint(dst, cfg, state, store)
    if (folder / ACCEPTANCE).exists():  # a cut drafter keeps the trained one's as its prior
        shutil.copy2(folder / ACCEPTANCE, dst / ACCEPTANCE)
    readable_files(dst)
    return out | {"bytes": (dst / "model.safetensors").stat().st_size}


def run_compact(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(compact(Path(args.src), Path(args.dst), args.store, args.rank)))
    except DrafterFormatError as e:  # before anything is written
        print(f"d3d compact: error: {e}", file=sys.stderr)
        return 2
    return 0
