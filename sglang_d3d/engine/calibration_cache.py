"""Calibration results kept between starts, keyed by the CPU, the weights and the settings.

A start with the same CPU, the same target and drafter files and the same engine settings reuses
the times the last start measured (engine/calibrate.py) instead of measuring them again. Any
change in one of those makes a new key, so a stale file is never read; a file that does not
parse is ignored and measured over.

    $D3D_CALIBRATION_CACHE/<key>.json   (default: $D3D_CACHE_DIR/calibration, where
                                         $D3D_CACHE_DIR defaults to ~/.cache/sglang-d3d)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from sglang_d3d.models.cpu_kernels import cpuinfo
from sglang_d3d.speculative.cycle import Plan

log = logging.getLogger(__name__)

# (bucket, plan, seconds, samples): one measured time, as the controller's seed_time takes it
Time = tuple[int, Plan, float, int]


def cache_dir() -> Path:
    """Where the calibration files live (see the module's note)."""
    from sglang_d3d.models.loading import cache_dir as models_cache

    own = os.environ.get("D3D_CALIBRATION_CACHE")
    return Path(own) if own else models_cache() / "calibration"


def cpu_name() -> str:
    """/proc/cpuinfo's model name, family and model, and the logical CPU count."""
    fields = cpuinfo()
    name = fields.get("model name", platform.processor() or platform.machine())
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, " \
           f"{os.cpu_count()} CPUs)"


def _files(folder: str | None) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of each file in a model folder: a changed weight file, a new key."""
    if not folder or not Path(folder).is_dir():
        return []
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                  for p in Path(folder).iterdir() if p.is_file())


def cache_key(cfg, target_dir: str | None, drafter_dir: str | None) -> dict:
    """Everything a calibrated time depends on, as JSON: the CPU, torch and thread count, the
    weights' files, and every engine setting."""
    return {
        "cpu": cpu_name(), "torch": torch.__version__, "sglang_d3d": _version(),
        "target": _files(target_dir), "drafter": _files(drafter_dir),
        "settings": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-d3d")
    except PackageNotFoundError:
        return "unknown"


def key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def load(key: dict, folder: Path | None = None) -> list[Time]:
    """The times stored under `key`, or [] when there are none (or the file is unreadable)."""
    path = (folder or cache_dir()) / f"{key_name(key)}.json"
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key)):
            return []
        return [(int(b), Plan(int(block), bool(overlap)), float(s), int(n))
                for b, block, overlap, s, n in data["times"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the calibration file %s (%s); measuring again", path, e)
        return []


def save(key: dict, times: list[Time], folder: Path | None = None) -> Path | None:
    """Store `times` under `key`; None (and a warning) where the folder cannot be written."""
    folder = folder or cache_dir()
    path = folder / f"{key_name(key)}.json"
    rows = [[b, p.block, p.overlap, s, n] for b, p, s, n in times]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "times": rows}, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:
        log.warning("could not keep the calibration in %s (%s): the next start measures again",
                    folder, e)
        return None
    return path
