"""From distillation samples to collated training batches, with a resumable data position.

The order of epoch e is a pure function of (seed, e, number of samples), so a checkpoint only
needs (epoch, batch index, number of samples at the epoch's start) to continue exactly where it
stopped. Shards are append-only, so the first n samples never change while datagen adds more.

Under data parallelism every rank draws the anchors and block sizes of every row of a global
batch (the same random stream on every rank, so the generator's state stays one state), then
reads and collates only its own rows: N ranks see exactly the rows one process would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sglang_d3d.training.objective import (
    Example,
    build_example,
    collate,
    sample_anchors,
    sample_block_sizes,
)
from sglang_d3d.training.shards import Sample, open_shards

LAYOUT = "layout"  # batch key: [3] long (first global row of this part, global rows, global slots)


@dataclass(frozen=True)
class BatchSpec:
    block_size: int = 16
    num_anchors: int = 24  # mask blocks per sequence
    min_block_size: int = 0  # >0: each block's size uniform in [min_block_size, block_size]
    max_seq_len: int = 512  # prompt + response, cropped at the end beyond this
    batch_size: int = 4  # global: sequences per micro-batch over all ranks


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    batch: int = 0  # batches of this epoch already consumed
    num_samples: int = 0  # training samples the epoch was cut from (0: not started)


class SampleView(Sequence):
    """Samples by index into a (possibly lazy) sequence, with every sample's prompt and total
    length known without reading its tokens."""

    def __init__(self, source: Sequence, index: np.ndarray, lengths: np.ndarray,
                 prompt_lens: np.ndarray) -> None:
        self.source, self.index = source, index  # [N] positions in source
        self.lengths, self.prompt_lens = lengths, prompt_lens  # [N] each

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> SampleView:
        lengths = np.array([len(s.prompt) + len(s.response) for s in samples], dtype=np.int64)
        prompts = np.array([len(s.prompt) for s in samples], dtype=np.int64)
        return cls(samples, np.arange(len(samples)), lengths, prompts)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SampleView(self.source, self.index[i], self.lengths[i], self.prompt_lens[i])
        return self.source[int(self.index[i])]


def is_heldout(sample: Sample, every: int) -> bool:
    """Held-out by prompt index, so the split stays fixed while datagen keeps adding shards."""
    return every > 0 and sample.prompt_index % every == every - 1


def split(samples: list[Sample], every: int) -> tuple[list[Sample], list[Sample]]:
    train = [s for s in samples if not is_heldout(s, every)]
    held = [s for s in samples if is_heldout(s, every)]
    return train, held


def open_split(folder: Path, every: int) -> tuple[SampleView, SampleView]:
    """(train, held-out) views of a datagen folder's shards, read lazily: only lengths and
    record indices are in memory until a sample's tokens are needed."""
    shards = open_shards(Path(folder), cache_shards=64)  # shuffled rows revisit shards
    held = heldout_mask(shards.prompt_indices, every)
    prompts = np.concatenate([ix.prompt_len for ix in shards.indexes] or [np.zeros(0)])
    lengths, prompts = shards.lengths, prompts.astype(np.int64)
    train_idx, held_idx = np.nonzero(~held)[0], np.nonzero(held)[0]
    return (SampleView(shards, train_idx, lengths[train_idx], prompts[train_idx]),
            SampleView(shards, held_idx, lengths[held_idx], prompts[held_idx]))


def heldout_mask(prompt_indices: np.ndarray, every: int) -> np.ndarray:
    """[N] bool, is_heldout over record indices."""
    if every <= 0:
        return np.zeros(len(prompt_indices), dtype=bool)
    return prompt_indices % every == every - 1


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of every batch of epoch `epoch`, in order. Sequences of similar length are
    grouped (less padding) within windows of 16 batches, so epochs still differ."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    window = batch_size * 16
    out = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: lengths[i])
        groups = [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
        out += [groups[g] for g in torch.randperm(len(groups), generator=gen).tolist()]
    return out


def draw_blocks(prompt_len: int, total_len: int, spec: BatchSpec, gen: torch.Generator):
    """One sequence's random draws: (anchors [K], block size or [K] sizes). Needs only the
    lengths, so ranks draw for rows they never read."""
    t = min(total_len, spec.max_seq_len)
    anchors = sample_anchors(min(prompt_len, t - 1), t, spec.num_anchors, gen)
    if spec.min_block_size:
        return anchors, sample_block_sizes(anchors.numel(), spec.min_block_size,
                                           spec.block_size, gen)
    return anchors, spec.block_size


def num_slots(anchors: torch.Tensor, sizes: int | torch.Tensor) -> int:
    """Mask slots of one sequence: the sum of its blocks' B - 1."""
    if isinstance(sizes, int):
        return anchors.numel() * (sizes - 1)
    return int((sizes - 1).sum())


def example_for(sample: Sample, spec: BatchSpec, gen: torch.Generator) -> Example:
    ids = torch.from_numpy(sample.ids[: spec.max_seq_len]).long()
    return build_example(ids, *draw_blocks(len(sample.prompt), len(sample.ids), spec, gen))


def global_batch(samples: SampleView, rows: list[int], spec: BatchSpec, gen: torch.Generator,
                 part: slice | None = None) -> dict[str, torch.Tensor]:
    """Draw every row of the global batch `rows`; read, build and collate the rows `part`
    (default: all) of it. The batch carries LAYOUT for the loss rows' draws."""
    draws = [draw_blocks(int(samples.prompt_lens[i]), int(samples.lengths[i]), spec, gen)
             for i in rows]
    part = part or slice(0, len(rows))
    mine = []
    for i, (anchors, sizes) in zip(rows[part], draws[part]):
        ids = torch.from_numpy(samples[i].ids[: spec.max_seq_len]).long()
        mine.append(build_example(ids, anchors, sizes))
    batch = collate(mine)
    batch[LAYOUT] = torch.tensor([part.start, len(rows), max(num_slots(*d) for d in draws)])
    return batch


def iterate_batches(
    samples: Sequence[Sample], spec: BatchSpec, seed: int, pos: DataPosition,
    gen: torch.Generator, rank: int = 0, world: int = 1,
) -> Iterator[tuple[DataPosition, dict[str, torch.Tensor]]]:
    """Batches of one epoch from `pos` on; yields the position *after* each batch. With
    world > 1, each batch holds rank `rank`'s share of the global batch's rows; a batch of
    fewer rows than ranks (an epoch's last, short one) is skipped by every rank alike."""
    view = samples if isinstance(samples, SampleView) else SampleView.of(samples)
    use = view[: pos.num_samples] if pos.num_samples else view
    batches = epoch_batches(use.lengths.tolist(), spec.batch_size, seed, pos.epoch)
    for b in range(pos.batch, len(batches)):
        after = DataPosition(pos.epoch, b + 1, len(use))
        rows = batches[b]
        if len(rows) < world:
            continue
        part = slice(rank * len(rows) // world, (rank + 1) * len(rows) // world)
        yield after, global_batch(use, rows, spec, gen, part)
