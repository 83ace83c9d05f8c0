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
from dataclasses import dataclass, field
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


@dataclass
class NgramIndex:
    """`lookup_continuation` for a text that grows at its end, without reading it all again:
    every n-gram (1 to `max_ngram` tokens) that has a token after it, mapped to its latest
    start. Each lookup first indexes the tokens added since the last, so a cycle costs a few
    dictionary operations per new token, not a pass over the context (the numpy scan took
    about 350 us a cycle at 300-700 tokens, 4% of a plain step on the 4-bit CPU path).
    Texts grow by appending; a rewritten history is a new list (`Drafting.restart`). A text
    that is another list, shorter than the one indexed, or whose last indexed token changed,
    is indexed afresh."""

    max_ngram: int = 4
    _text: list[int] | None = None  # the list indexed (by identity)
    _ends: int = 0  # the n-grams ending (exclusively) at positions <= _ends are in
    _mark: int | None = None  # the token at position _ends when it was indexed
    _start: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> latest start

    def continuation(self, tokens: list[int], length: int, min_ngram: int = 2) -> list[int]:
        """`lookup_continuation(tokens, length, self.max_ngram, min_ngram)`, the same list."""
        if length <= 0:
            return []
        self._catch_up(tokens)
        last = len(tokens)
        for n in range(min(self.max_ngram, last - 1), max(min_ngram, 1) - 1, -1):
            start = self._start.get(tuple(tokens[last - n :]))
            if start is not None:
                return _copy(tokens, start + n, length)
        return []

    def continuation_after(self, tokens: list[int], extra: int, length: int,
                           min_ngram: int = 2) -> list[int]:
        """`lookup_continuation(tokens + [extra], length, self.max_ngram, min_ngram)`, the same
        list, without building that text (a row's copy after its first draft, `extra`): the
        n-grams followed by a token inside `tokens` are indexed, and the one n-gram per length
        that `extra` follows (the last n tokens) is checked on its own; it is the latest."""
        if length <= 0:
            return []
        self._catch_up(tokens)
        last = len(tokens)  # the virtual text's last position holds `extra`
        text = _Appended(tokens, extra)
        for n in range(min(self.max_ngram, last), max(min_ngram, 1) - 1, -1):
            gram = (*tokens[last + 1 - n : last], extra)
            start = last - n if tuple(tokens[last - n : last]) == gram else self._start.get(gram)
            if start is not None:
                return _copy(text, start + n, length)
        return []

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a token after them: those ending before the last."""
        if tokens is not self._text or len(tokens) - 1 < self._ends or \
                (self._ends and tokens[self._ends] != self._mark):
            self._text, self._ends, self._start = tokens, 0, {}
        for end in range(self._ends + 1, len(tokens)):  # n-grams tokens[end - n : end]
            for n in range(1, min(self.max_ngram, end) + 1):
                self._start[tuple(tokens[end - n : end])] = end - n  # later starts overwrite
        self._ends = max(self._ends, len(tokens) - 1)
        self._mark = tokens[self._ends] if tokens else None


class _Appended(Sequence[int]):
    """`tokens + [extra]` as `_copy` reads it (its length and single items), without a copy."""

    def __init__(self, tokens: Sequence[int], extra: int) -> None:
        self.tokens, self.extra = tokens, extra

    def __len__(self) -> int:
        return len(self.tokens) + 1

    def __getitem__(self, i):  # int indices only, as _copy uses them
        return self.extra if i == len(self.tokens) else self.tokens[i]


def _copy(ctx: Sequence[int], start: int, length: int) -> list[int]:
    """ctx[start:] then, past the end, the copy itself: position L + j repeats start + j.
    Reads `length` tokens of the caller's sequence, never converts the whole context."""
    out: list[int] = []
    for i in range(start, start + length):
        out.append(int(ctx[i]) if i < len(ctx) else out[i - len(ctx)])
    return out
