"""Completed datagen records on disk before their shard is whole, so a stop loses nothing.

Records complete out of order (many requests in flight), but shard k must hold records
[k*S, (k+1)*S). Each finished record is appended to its shard's journal,
`shard_XXXXX.partial.jsonl`, and flushed to disk before the next one is taken. When a shard's
journal holds all its records, they are packed into the shard (written atomically), the
manifest lists it, and the journal is deleted. A restart reads the journals and skips every
record in them; a line cut short by a kill is dropped (its record is generated again), so no
record is ever lost or stored twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_d3d.training.shards import Sample, shard_name, write_shard


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    response: list[int]
    finished: bool


@dataclass(frozen=True)
class Record:
    """One prompt-list entry's answers: one Turn per assistant turn generated."""

    index: int
    source: int
    turns: tuple[Turn, ...]
    retokenized: int = 0  # turns whose ids were re-tokenized from text
    mismatches: int = 0  # of those, texts whose round trip decode(encode(text)) differed

    def to_json(self) -> str:
        turns = [[t.prompt, t.response, t.finished] for t in self.turns]
        return json.dumps({"index": self.index, "source": self.source, "turns": turns,
                           "retokenized": self.retokenized, "mismatches": self.mismatches},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Record:
        d = json.loads(line)
        turns = tuple(Turn(list(p), list(r), bool(f)) for p, r, f in d["turns"])
        return cls(int(d["index"]), int(d["source"]), turns, int(d.get("retokenized", 0)),
                   int(d.get("mismatches", 0)))


def journal_path(out: Path, shard: int) -> Path:
    return Path(out) / shard_name(shard).replace(".npz", ".partial.jsonl")


def read_journal(path: Path) -> dict[int, Record]:
    """The whole records of one journal; rewrites it without a torn last line."""
    if not path.exists():
        return {}
    records: dict[int, Record] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        try:
            rec = Record.from_json(line)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # cut by a kill mid-write: generated again
        records.setdefault(rec.index, rec)
    if len(records) != len(lines):
        _rewrite(path, records)
    return records


def _rewrite(path: Path, records: dict[int, Record]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r.to_json() + "\n" for r in records.values()), encoding="utf-8")
    os.replace(tmp, path)


def append_record(path: Path, rec: Record) -> None:
    """Durable before returning: flushed and fsync'ed."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(rec.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


def shard_samples(records: list[Record]) -> tuple[list[Sample], list[bool]]:
    """Records (in index order) -> one Sample per turn, and whether each response finished."""
    samples, finished = [], []
    for rec in records:
        for t, turn in enumerate(rec.turns):
            samples.append(Sample(np.array(turn.prompt, dtype=np.int64),
                                  np.array(turn.response, dtype=np.int64), rec.source, rec.index, t))
            finished.append(turn.finished)
    return samples, finished


def pack_shard(out: Path, shard: int, records: list[Record]) -> list[Sample]:
    """Write shard `shard` from its records. The caller lists it in the manifest, then drops
    the journal: a kill in between leaves the journal, and the shard is packed again."""
    samples, finished = shard_samples(sorted(records, key=lambda r: r.index))
    write_shard(Path(out) / shard_name(shard), samples, finished)
    return samples
