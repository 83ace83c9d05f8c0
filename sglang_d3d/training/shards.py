"""Token-id shards of distillation data: compact on disk, written atomically, read as samples.

One shard = one `.npz` with uint16 arrays (the 49k vocabulary fits in 16 bits):
  tokens      [sum of lengths]  prompt ids then response ids of every sample, concatenated
  prompt_len  [S] int32, resp_len [S] int32
  prompt_index[S] int32  position of the prompt in the datagen prompt list (for dedup checks)
  source      [S] uint8  0 = GSM8K train, 1 = instruction/code mix
  finished    [S] bool   the response ended with EOS (False: cut at max_new_tokens)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Sample:
    prompt: np.ndarray  # [P] int64
    response: np.ndarray  # [R] int64
    source: int
    prompt_index: int

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.response])


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.npz"


def write_shard(path: Path, samples: list[Sample], finished: list[bool]) -> None:
    """Write via a temporary file and rename, so a killed run never leaves half a shard."""
    tokens = np.concatenate([s.ids for s in samples]) if samples else np.zeros(0)
    if tokens.size and tokens.max() > np.iinfo(np.uint16).max:
        raise ValueError("token id does not fit in uint16")
    arrays = dict(
        tokens=tokens.astype(np.uint16),
        prompt_len=np.array([len(s.prompt) for s in samples], dtype=np.int32),
        resp_len=np.array([len(s.response) for s in samples], dtype=np.int32),
        prompt_index=np.array([s.prompt_index for s in samples], dtype=np.int32),
        source=np.array([s.source for s in samples], dtype=np.uint8),
        finished=np.array(finished, dtype=bool),
    )
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sample]:
    with np.load(path) as z:
        tokens = z["tokens"].astype(np.int64)
        plen, rlen = z["prompt_len"], z["resp_len"]
        pidx, src = z["prompt_index"], z["source"]
    out, start = [], 0
    for p, r, i, s in zip(plen, rlen, pidx, src, strict=True):
        out.append(Sample(tokens[start : start + p], tokens[start + p : start + p + r], int(s), int(i)))
        start += p + r
    return out


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def write_manifest(folder: Path, manifest: dict) -> None:
    path = Path(folder) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def load_samples(folder: Path) -> list[Sample]:
    """Every sample of every shard listed in the manifest, in shard order."""
    folder = Path(folder)
    names = read_manifest(folder).get("shards", [])
    return [s for name in names for s in read_shard(folder / name)]
