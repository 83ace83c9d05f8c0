"""Guesses read off a corpus of the target's own answers: what the target most often said after
a row's last few tokens, token after token (an n-gram model of its own text).

Where a row's own text (lookup.py) and earlier requests' (shared_lookup.py) have no copy, a
cycle drafts, and on this project's CPU a drafter pass costs nearly a plain step (44 ms against
50-57). The corpus the drafter was distilled on is the target's own greedy answers (`d3d
datagen`, 1.02M tokens for the default pair), so the target says the same things again: a
worked GSM8K step, a code answer's boilerplate. A lookup here costs microseconds and the target
verifies what it proposes, so outputs never change; a wrong guess costs its cycle. Where the
longest context that occurred is short, or the corpus went several ways after it, the cycle
drafts as before (`CorpusSetting`). Greedy rows only: sampled rows copying from it too ran
level with no corpus at temperature 0.7 (its guesses are the target's likeliest tokens, which
a draw keeps less often), so they keep to their own text.

Each order n keeps, for every n tokens that occurred, the `TOP` tokens that most often followed
them and their shares of what followed, as sorted 64-bit hashes (a collision costs a guess, never
an output). Beside a row's first copy, a cycle of copies also verifies the corpus's other likely
continuations as one token tree (`guesses`, best first by the product of shares along a path):
where the target's answers went several ways, the tree holds the likeliest of them. Measured
with `d3d bench` (batch 1, greedy, 128 tokens, the step-600 drafter, side by side in one run):
async with the corpus 1.92x of ar against 1.82x without on GSM8K, 2.12x against 1.94x on code
(MBPP 1-20), level on MT-Bench (1.51x); the tree beside a copy ran level with the copy alone.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sglang_d3d.models.corpus import first_tokens

MASK = (1 << 64) - 1
MUL = 0x9E3779B97F4A7C15  # odd: the rolling hash of n tokens is h = h * MUL + (token + 1)
TOP = 3  # next tokens kept per context: a node's children in a tree of guesses


@dataclass(frozen=True)
class CorpusSetting:
    """Which contexts count. Offline, on the default pair's cycles that had no copy of their
    own (`d3d bench` prompts, the target's answers), a first guess from a context of 3 or more
    tokens that at least half the time went on as guessed paid on GSM8K, MT-Bench and code
    alike; shorter or less certain ones lost against drafting on MT-Bench."""

    orders: tuple[int, ...] = (6, 5, 4, 3, 2)  # context lengths kept, longest first
    min_order: int = 3  # the first guess: its longest context that occurred is this long...
    min_share: float = 0.5  # ... and went on as guessed at least this share of the time

    def __post_init__(self) -> None:
        longest_first = list(self.orders) == sorted(self.orders, reverse=True)
        if not self.orders or min(self.orders) < 1 or not longest_first:
            raise ValueError(f"orders must be positive and longest first, not {self.orders}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], not {self.min_share}")


@dataclass(frozen=True)
class OrderTable:
    """Every n-token context that occurred: keys [U] uint64 sorted; what followed it, likeliest
    first (ties: the smallest id), at most `TOP` tokens: tokens[starts[i]:starts[i + 1]] [<=TOP]
    int32 and their shares of what followed [<=TOP] float32."""

    keys: np.ndarray
    starts: np.ndarray  # [U + 1] int32
    tokens: np.ndarray
    shares: np.ndarray

    def find(self, key: int) -> tuple[int, float] | None:
        """The likeliest next token after the context hashed to `key`, and its share."""
        options = self.options(key)
        return options[0] if options else None

    def options(self, key: int) -> list[tuple[int, float]]:
        """(token, share) of what followed the context hashed to `key`, likeliest first."""
        keys, starts, tokens, shares = self._views
        i = bisect.bisect_left(keys, key)
        if i == len(keys) or keys[i] != key:
            return []
        a, b = starts[i], starts[i + 1]
        return list(zip(tokens[a:b].tolist(), shares[a:b].tolist()))

    @cached_property
    def _views(self) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        """The arrays as memoryviews, searched with `bisect`: a lookup reads a few items, and
        numpy's call machinery cost more than the search itself. With caches as a 4-bit
        step leaves them, a search of the default corpus's order-3 table took 76 us through
        `np.searchsorted` and 16 us this way (`benchmarks/bench_corpus_lookup.py`)."""
        return (memoryview(self.keys), memoryview(self.starts), memoryview(self.tokens),
                memoryview(self.shares))


class CorpusIndex:
    """The n-gram tables of a corpus of token sequences (never across two sequences), and
    counters for the metrics: how often a row looked here, and found a guess."""

    def __init__(self, sequences: Sequence[Sequence[int]],
                 setting: CorpusSetting = CorpusSetting()) -> None:
        self.setting = setting
        flat = _joined(sequences)  # [L] int64, -1 between sequences
        self.tables = {n: _table(flat, n) for n in setting.orders}
        self.num_tokens = int((flat >= 0).sum())
        self.lookups = self.found = 0

    def __len__(self) -> int:
        return self.num_tokens

    def continuation(self, tokens: Sequence[int], length: int) -> list[int]:
        """Up to `length` guesses after `tokens`: the first only where `CorpusSetting` trusts
        its context, then each from the longest context that occurred; [] if none."""
        if length <= 0:
            return []
        self.lookups += 1
        s = self.setting
        ctx = [int(t) for t in tokens[-s.orders[0]:]]
        out: list[int] = []
        while len(out) < length:
            first = not out
            guess = self._next(ctx, s.min_order if first else 1, s.min_share if first else 0.0)
            if guess is None:
                break
            out.append(guess)
            ctx = (ctx + [guess])[-s.orders[0]:]  # no context is longer than the longest order
        self.found += bool(out)
        return out

    def guesses(self, tokens: Sequence[int], length: int, nodes: int) -> list[list[int]]:
        """Up to `nodes` guesses after `tokens` as the paths to a tree's nodes (each node's
        path, parents first), likeliest first by the product of shares along a path, at most
        `length` deep; each node's children are what followed the longest context of its path
        that occurred. For a cycle of copies that verifies a trusted copy anyway: no
        `CorpusSetting` threshold applies, and the counters do not count these."""
        if length <= 0 or nodes <= 0:
            return []
        ctx = [int(t) for t in tokens[-self.setting.orders[0]:]]
        tie = itertools.count()  # equal scores: the earlier pushed (the likelier sibling) first
        heap: list[tuple[float, int, tuple[int, ...]]] = [(-1.0, next(tie), ())]
        out: list[list[int]] = []
        while heap and len(out) < nodes:
            score, _, path = heapq.heappop(heap)
            if path:
                out.append(list(path))
            if len(path) < length:
                for token, share in self._longest(ctx + list(path))[1]:
                    heapq.heappush(heap, (score * share, next(tie), (*path, token)))
        return out

    def _longest(self, ctx: list[int], min_order: int = 1) -> tuple[int, list[tuple[int, float]]]:
        """(n, what followed) for the longest context of `ctx`'s tail that occurred, n tokens
        long and at least `min_order`; (0, []) where none did. A context occurred only where
        its own tail did, so where orders below `min_order` are left out, the shortest counted
        one is searched first: where it never occurred no longer one did, and one search
        settles most first guesses, against one per order (`bench_cycle_overhead.py`)."""
        counted = [n for n in self.setting.orders if min_order <= n <= len(ctx)]
        if counted and counted[-1] != self.setting.orders[-1] and not self._options(ctx, counted[-1]):
            return 0, []
        for n in counted:
            if found := self._options(ctx, n):
                return n, found
        return 0, []

    def _options(self, ctx: list[int], n: int) -> list[tuple[int, float]]:
        """What followed `ctx`'s last n tokens in the corpus, likeliest first."""
        return self.tables[n].options(hash_tokens(ctx[-n:]))

    def _next(self, ctx: list[int], min_order: int, min_share: float) -> int | None:
        """The guess of the longest context of `ctx`'s tail that occurred, if that context is
        at least `min_order` long and its guess's share at least `min_share`."""
        _, found = self._longest(ctx, min_order)
        if not found:
            return None
        token, share = found[0]
        return token if share >= min_share else None


def corpus_index(drafter, max_tokens: int) -> CorpusIndex | None:
    """The index of `drafter`'s corpus (its answers in order while they fit in `max_tokens`),
    or None where it has none or `max_tokens` is 0. Both hosts build theirs with it."""
    answers = getattr(drafter, "corpus", None)
    if not answers or max_tokens <= 0:
        return None
    return CorpusIndex(first_tokens(answers, max_tokens))


def hash_tokens(tokens: Sequence[int]) -> int:
    """The rolling hash `_table` gives the same tokens (Python ints, 64 bits)."""
    h = 0
    for t in tokens:
        h = (h * MUL + int(t) + 1) & MASK
    return h


def _joined(sequences: Sequence[Sequence[int]]) -> np.ndarray:
    parts = []
    for seq in sequences:
        parts.append(np.asarray(seq, dtype=np.int64).reshape(-1))
        parts.append(np.full(1, -1, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _table(flat: np.ndarray, n: int) -> OrderTable:
    """flat [L] (-1 between sequences) -> the order-n table."""
    if len(flat) <= n:
        return _empty()
    windows = sliding_window_view(flat[:-1], n)  # [L-n, n]: the context of flat[n:]
    nxt = flat[n:]  # [L-n]
    ok = (windows >= 0).all(axis=1) & (nxt >= 0)
    windows, nxt = windows[ok], nxt[ok]
    if not len(nxt):
        return _empty()
    h = np.zeros(len(nxt), dtype=np.uint64)
    with np.errstate(over="ignore"):  # wraps modulo 2^64, as hash_tokens does
        for j in range(n):
            h = h * np.uint64(MUL) + (windows[:, j] + 1).astype(np.uint64)
    order = np.lexsort((nxt, h))
    h, nxt = h[order], nxt[order]
    starts = np.flatnonzero(np.r_[True, (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])])
    ph, pn = h[starts], nxt[starts]  # one row per (context, next token) pair
    count = np.diff(np.r_[starts, len(h)])
    ranked = np.lexsort((pn, -count, ph))  # by context, then likeliest first, then smaller id
    ph, pn, count = ph[ranked], pn[ranked], count[ranked]
    groups = np.flatnonzero(np.r_[True, ph[1:] != ph[:-1]])  # each context's first pair
    sizes = np.diff(np.r_[groups, len(ph)])
    total = np.add.reduceat(count, groups)
    rank = np.arange(len(ph)) - np.repeat(groups, sizes)  # within its context
    keep = rank < TOP
    share = count / np.repeat(total, sizes)
    kept = np.minimum(sizes, TOP)
    return OrderTable(ph[groups], np.r_[0, np.cumsum(kept)].astype(np.int32),
                      pn[keep].astype(np.int32), share[keep].astype(np.float32))


def _empty() -> OrderTable:
    return OrderTable(np.zeros(0, np.uint64), np.zeros(1, np.int32), np.zeros(0, np.int32),
                      np.zeros(0, np.float32))
