"""From distillation samples to packed training batches, the held-out split and the head ids."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from sglang_d3d.training.objective import (
    ar_label_row,
    build_example,
    collate,
    sample_anchors,
)
from sglang_d3d.training.shards import Sample


@dataclass(frozen=True)
class BatchSpec:
    block_size: int = 16
    num_anchors: int = 16  # anchors (mask blocks) per sequence
    ar_positions: int = 32  # clean positions with an AR label per sequence
    max_seq_len: int = 512  # prompt + response, cropped at the end beyond this
    batch_size: int = 8


def is_heldout(sample: Sample, every: int) -> bool:
    """Held-out by prompt index, so the split stays fixed while datagen keeps adding shards."""
    return every > 0 and sample.prompt_index % every == every - 1


def split(samples: list[Sample], every: int) -> tuple[list[Sample], list[Sample]]:
    train = [s for s in samples if not is_heldout(s, every)]
    held = [s for s in samples if is_heldout(s, every)]
    return train, held


def head_ids_by_frequency(samples: list[Sample], k: int, vocab: int, keep: tuple[int, ...]) -> torch.Tensor:
    """[k] the k most frequent response token ids (FR-Spec), always including `keep` (EOS).

    Responses, not prompts: the drafter only ever proposes response tokens.
    """
    counts = np.zeros(vocab, dtype=np.int64)
    for s in samples:
        np.add.at(counts, s.response, 1)
    counts[list(keep)] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:k]
    return torch.from_numpy(np.sort(top)).long()


def example_for(sample: Sample, spec: BatchSpec, gen: torch.Generator):
    ids = torch.from_numpy(sample.ids[: spec.max_seq_len]).long()
    p = min(len(sample.prompt), ids.numel() - 1)
    anchors = sample_anchors(p, ids.numel(), spec.num_anchors, gen)
    ar = ar_label_row(ids, p - 1, spec.ar_positions, gen)
    return build_example(ids, anchors, spec.block_size, ar)


def iterate_batches(
    samples: list[Sample], spec: BatchSpec, gen: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """One shuffled epoch; batches group sequences of similar length to limit padding."""
    order = torch.randperm(len(samples), generator=gen).tolist()
    # Sort within windows of 16 batches: similar lengths together, epochs still differ.
    window = spec.batch_size * 16
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: len(samples[i].ids))
        groups = [chunk[b : b + spec.batch_size] for b in range(0, len(chunk), spec.batch_size)]
        for g in torch.randperm(len(groups), generator=gen).tolist():
            yield collate([example_for(samples[i], spec, gen) for i in groups[g]])
