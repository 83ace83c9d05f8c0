"""Token-id shards of distillation data: compact on disk, written atomically, read lazily.

One shard = one `.npz` (each member compressed on its own, so the small ones load alone):
  tokens      [sum of lengths] uint32  prompt ids then response ids of every sample, concatenated
                                       (shards written before vocabularies above 65,536 were
                                       supported hold uint16; both load)
  prompt_len  [S] int32, resp_len [S] int32
  prompt_index[S] int32  position of the record in the datagen prompt list (for dedup checks)
  turn        [S] int32  the assistant turn of a multi-turn record (absent in older shards: 0)
  source      [S] uint8  0 = GSM8K train, 1 = instruction/code mix, 2 + i = the i-th --prompts file
  finished    [S] bool   the response ended with EOS (False: cut at max_new_tokens)

Two ways to read: `load_samples(folder)` returns every sample in memory (small data sets);
`open_shards(folder)` returns a `ShardSet`, a sequence of samples that holds only the per-sample
lengths and indices in memory and decompresses a shard's tokens when one of its samples is read
(a few recently used shards are kept).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKEN_DTYPE = np.uint32  # any vocabulary (Llama-3: 128k, Qwen: 152k)


@dataclass(frozen=True)
class Sample:
    prompt: np.ndarray  # [P] int64
    response: np.ndarray  # [R] int64
    source: int
    prompt_index: int
    turn: int = 0  # assistant turn within its record (multi-turn conversations)

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.response])


def crop(sample: Sample, max_len: int) -> Sample:
    """The sample's first max_len tokens (prompt first), as training reads it."""
    p = sample.prompt[:max_len]
    return replace(sample, prompt=p, response=sample.response[: max_len - len(p)])


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.npz"


def write_shard(path: Path, samples: list[Sample], finished: list[bool]) -> None:
    """Write via a temporary file and rename, so a killed run never leaves half a shard."""
    tokens = np.concatenate([s.ids for s in samples]) if samples else np.zeros(0, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError("token id outside [0, 2**32)")
    arrays = dict(
        tokens=tokens.astype(TOKEN_DTYPE),
        prompt_len=np.array([len(s.prompt) for s in samples], dtype=np.int32),
        resp_len=np.array([len(s.response) for s in samples], dtype=np.int32),
        prompt_index=np.array([s.prompt_index for s in samples], dtype=np.int32),
        turn=np.array([s.turn for s in samples], dtype=np.int32),
        source=np.array([s.source for s in samples], dtype=np.uint8),
        finished=np.array(finished, dtype=bool),
    )
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


@dataclass(frozen=True)
class ShardIndex:
    """One shard's per-sample metadata (small), without its tokens."""

    prompt_len: np.ndarray  # [S] int32
    resp_len: np.ndarray  # [S] int32
    prompt_index: np.ndarray  # [S] int32
    turn: np.ndarray  # [S] int32
    source: np.ndarray  # [S] uint8

    @property
    def starts(self) -> np.ndarray:
        """[S] offset of each sample's first token in the shard's `tokens`."""
        lengths = (self.prompt_len + self.resp_len).astype(np.int64)
        return np.cumsum(lengths) - lengths


def read_index(path: Path) -> ShardIndex:
    with np.load(path) as z:
        plen = z["prompt_len"]
        turn = z["turn"] if "turn" in z.files else np.zeros_like(plen)
        return ShardIndex(plen, z["resp_len"], z["prompt_index"], turn, z["source"])


def _samples(tokens: np.ndarray, ix: ShardIndex) -> list[Sample]:
    tokens = tokens.astype(np.int64)
    out = []
    for start, p, r, i, t, s in zip(ix.starts, ix.prompt_len, ix.resp_len, ix.prompt_index,
                                    ix.turn, ix.source, strict=True):
        out.append(Sample(tokens[start : start + p], tokens[start + p : start + p + r], int(s),
                          int(i), int(t)))
    return out


def read_shard(path: Path) -> list[Sample]:
    with np.load(path) as z:
        tokens = z["tokens"]
    return _samples(tokens, read_index(path))


class ShardSet(Sequence):
    """The samples of a datagen folder's listed shards, in order, read on demand.

    In memory: every sample's lengths, record index, turn and source (a few bytes each), plus
    the decompressed tokens of the last `cache_shards` shards used. Reading samples in order
    decompresses each shard once; a shuffled order benefits from a bigger cache."""

    def __init__(self, paths: list[Path], cache_shards: int = 4) -> None:
        self.paths = paths
        self.indexes = [read_index(p) for p in paths]
        sizes = np.array([len(ix.prompt_len) for ix in self.indexes], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])  # [num_shards + 1]
        self._cache: OrderedDict[int, list[Sample]] = OrderedDict()
        self._cache_shards = max(1, cache_shards)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, i):  # int -> Sample; slice -> list[Sample]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = int(np.searchsorted(self._offsets, i, side="right") - 1)
        return self._shard(shard)[i - int(self._offsets[shard])]

    def __iter__(self) -> Iterator[Sample]:
        for k in range(len(self.paths)):
            yield from self._shard(k)

    def _shard(self, k: int) -> list[Sample]:
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        samples = read_shard(self.paths[k])
        self._cache[k] = samples
        if len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)
        return samples

    def _column(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(ix, name) for ix in self.indexes] or [np.zeros(0, np.int32)])

    @property
    def lengths(self) -> np.ndarray:
        """[N] prompt + response tokens of each sample, without reading any tokens."""
        return (self._column("prompt_len") + self._column("resp_len")).astype(np.int64)

    @property
    def prompt_indices(self) -> np.ndarray:
        """[N] each sample's record index (held-out splits by record need no tokens)."""
        return self._column("prompt_index").astype(np.int64)


def open_shards(folder: Path, cache_shards: int = 4) -> ShardSet:
    """The listed shards of a datagen folder as a lazy sequence of samples."""
    folder = Path(folder)
    names = read_manifest(folder).get("shards", [])
    return ShardSet([folder / name for name in names], cache_shards)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def write_manifest(folder: Path, manifest: dict) -> None:
    path = Path(folder) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def load_samples(folder: Path) -> list[Sample]:
    """Every sample of every shard listed in the manifest, in shard order, in memory."""
    return list(open_shards(folder))
