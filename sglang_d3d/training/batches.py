"""From distillation samples to collated training batches, with a resumable data position.

The order of epoch e is a pure function of (seed, e, number of samples), so a checkpoint only
needs (epoch, batch index, number of samples at the epoch's start) to continue exactly where it
stopped. Shards are append-only, so the first n samples never change while datagen adds more.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sglang_d3d.training.objective import (
    Example,
    build_example,
    collate,
    sample_anchors,
    sample_block_sizes,
)
from sglang_d3d.training.shards import Sample


@dataclass(frozen=True)
class BatchSpec:
    block_size: int = 16
    num_anchors: int = 24  # mask blocks per sequence
    min_block_size: int = 0  # >0: each block's size uniform in [min_block_size, block_size]
    max_seq_len: int = 512  # prompt + response, cropped at the end beyond this
    batch_size: int = 4


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    batch: int = 0  # batches of this epoch already consumed
    num_samples: int = 0  # training samples the epoch was cut from (0: not started)


def is_heldout(sample: Sample, every: int) -> bool:
    """Held-out by prompt index, so the split stays fixed while datagen keeps adding shards."""
    return every > 0 and sample.prompt_index % every == every - 1


def split(samples: list[Sample], every: int) -> tuple[list[Sample], list[Sample]]:
    train = [s for s in samples if not is_heldout(s, every)]
    held = [s for s in samples if is_heldout(s, every)]
    return train, held


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


def example_for(sample: Sample, spec: BatchSpec, gen: torch.Generator) -> Example:
    ids = torch.from_numpy(sample.ids[: spec.max_seq_len]).long()
    p = min(len(sample.prompt), ids.numel() - 1)
    anchors = sample_anchors(p, ids.numel(), spec.num_anchors, gen)
    sizes = spec.block_size
    if spec.min_block_size:
        sizes = sample_block_sizes(anchors.numel(), spec.min_block_size, spec.block_size, gen)
    return build_example(ids, anchors, sizes)


def iterate_batches(
    samples: list[Sample], spec: BatchSpec, seed: int, pos: DataPosition, gen: torch.Generator
) -> Iterator[tuple[DataPosition, dict[str, torch.Tensor]]]:
    """Batches of one epoch from `pos` on; yields the position *after* each batch."""
    use = samples[: pos.num_samples] if pos.num_samples else samples
    batches = epoch_batches([len(s.ids) for s in use], spec.batch_size, seed, pos.epoch)
    for b in range(pos.batch, len(batches)):
        after = DataPosition(pos.epoch, b + 1, len(use))
        yield after, collate([example_for(use[i], spec, gen) for i in batches[b]])
