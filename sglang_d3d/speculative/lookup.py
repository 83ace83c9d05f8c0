"""Guesses read off the request's own text: what followed the last earlier occurrence of its
latest few tokens (prompt lookup).

A chat model's answer repeats its prompt and itself (numbers and names from a GSM8K question,
an identifier in code, a looping answer), and there the D3D drafter is weakest: each of its
mask slots guesses alone, so its third draft is right about a third of the time, while a copied
run stays right as long as the text keeps repeating. The guesses cost no model pass. They ride
in the token tree the target verifies anyway (tree.py `graft`), or replace the drafter's pass
for a cycle (cycle.py `run_copy_cycle`); either way the target verifies them, so the output
never changes. Measured with `d3d bench` (batch 1, greedy, 128 tokens, the step-600 drafter,
against no copies in the same run): sync@4 1.90x of ar against 1.64x on GSM8K, 1.50x against
1.36x on MT-Bench, 1.59x against 1.46x on code (MBPP 1-10).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class CopySource(Protocol):
    """Text other than a row's own to copy guesses from (shared_lookup.TextIndex: earlier
    requests'; corpus_lookup.CorpusIndex: the target's answers in the drafter's corpus)."""

    def continuation(self, tokens: Sequence[int], length: int) -> list[int]:
        """Up to `length` guesses of what follows `tokens`; [] if it has none."""
        ...

    def guesses(self, tokens: Sequence[int], length: int, nodes: int) -> list[list[int]]:
        """Paths (at most `length` deep) to at most about `nodes` guessed tokens after `tokens`,
        likeliest first, for a tree of copies beside another copy; [] if it has none."""
        ...


def lookup_continuation(tokens: Sequence[int], length: int, max_ngram: int = 4,
                        min_ngram: int = 2) -> list[int]:
    """`length` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (max_ngram down to min_ngram tokens) that occurred before; [] if none did. Where
    that occurrence overlaps the end (text in a loop), the copy runs on into its own guesses,
    so a loop's period repeats. A 1-token match is right too rarely to be worth a verify slot
    (min_ngram 2)."""
    if length <= 0:
        return []
    ctx = np.asarray(tokens, dtype=np.int64)  # [L]
    for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
        # windows starting at s <= L-1-n, so a continuation token ctx[s + n] exists
        windows = sliding_window_view(ctx[:-1], n)  # [L-n, n]
        starts = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
        if starts.size:
            return _copy(tokens, int(starts[-1]) + n, length)
    return []


def _copy(ctx: Sequence[int], start: int, length: int) -> list[int]:
    """ctx[start:] then, past the end, the copy itself: position L + j repeats start + j.
    Reads `length` tokens of the caller's sequence, never converts the whole context."""
    out: list[int] = []
    for i in range(start, start + length):
        out.append(int(ctx[i]) if i < len(ctx) else out[i - len(ctx)])
    return out
