"""Guesses read off earlier requests' text: what followed the latest occurrence of a row's last
few tokens in the prompts and answers of requests that finished before it.

A row's own text (lookup.py) runs out of guesses where its answer says something it has not
said yet; a server's traffic says the same things again and again (the phrasing of a worked
GSM8K step, a code answer's boilerplate). Copies from either are verified by the target in a
cycle without a drafter pass, so the output never changes; a wrong guess costs that cycle.
Measured with `d3d bench` (batch 1, greedy, 128 tokens, with and without the index side by
side, the step-600 drafter): copy cycles 20% -> 40% of cycles on MBPP
code, 1.71x -> 1.86x of ar; MT-Bench 19% -> 21%, 1.55x -> 1.62x; GSM8K 37% -> 54% of cycles
but fewer tokens each, 1.87x and 1.85x.

Only greedy rows take these guesses. A sampled row's draws depend on what it is proposed, and
what other requests said before it must not change what a seeded request draws. Whoever can
time their own requests can tell whether a guess from this index was right (it comes back
sooner); a server whose tenants must not learn about each other's text turns it off
(EngineConfig.shared_lookup_tokens = 0), as with a shared prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

END = -1  # between two requests' texts: a copy never runs across it


class TextIndex:
    """Finished requests' texts, the newest `capacity` tokens of them at least and twice that
    at most, and for each `ngram`-token run in them where its latest occurrence ends. Memory
    stays bounded: past twice the capacity, all but the newest texts within `capacity` tokens
    are dropped and the index rebuilt (amortised O(1) a token)."""

    def __init__(self, capacity: int, ngram: int = 3) -> None:
        if capacity < 1 or ngram < 1:
            raise ValueError(f"capacity and ngram must be >= 1, not {capacity}, {ngram}")
        self.capacity, self.ngram = capacity, ngram
        self.text: list[int] = []
        self.base = 0  # absolute position of text[0]
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> absolute position after it
        self.lookups = self.found = 0  # for the metrics: how often a row found a copy here

    def __len__(self) -> int:
        return len(self.text)

    def add(self, tokens: Sequence[int]) -> None:
        """One finished request's text (prompt and answer)."""
        start = len(self.text)
        self.text.extend(int(t) for t in tokens)
        self.text.append(END)
        self._index(start)
        if len(self.text) > 2 * self.capacity:
            self._drop_oldest()

    def clear(self) -> None:
        """Forget every text (positions stay absolute: `base` is kept)."""
        self.text, self.after = [], {}

    def continuation(self, tokens: Sequence[int], length: int) -> list[int]:
        """Up to `length` tokens that followed the latest occurrence of `tokens`' last `ngram`
        tokens, stopping at the end of that request's text; [] if the run never occurred."""
        if length <= 0 or len(tokens) < self.ngram:
            return []
        self.lookups += 1
        out = self._after(tokens, length)
        self.found += bool(out)
        return out

    def guesses(self, tokens: Sequence[int], length: int, nodes: int) -> list[list[int]]:
        """The continuation as the one path of a tree's guesses (lookup.CopySource), beside
        another text's copy; not counted as a lookup."""
        if length <= 0 or nodes <= 0 or len(tokens) < self.ngram:
            return []
        out = self._after(tokens, length)
        return [out] if out else []

    def _after(self, tokens: Sequence[int], length: int) -> list[int]:
        at = self.after.get(tuple(tokens[-self.ngram :]))
        out = []
        for t in self.text[at - self.base : at - self.base + length] if at is not None else ():
            if t == END:
                break
            out.append(t)
        return out

    def _index(self, start: int) -> None:
        """Index the n-grams of the text from `start` on. A window holding END is skipped: it
        spans two texts, and no row's text holds END to look it up."""
        n, text = self.ngram, self.text
        for i in range(max(0, start - n + 1), len(text) - n):
            key = tuple(text[i : i + n])
            if END not in key:
                self.after[key] = self.base + i + n

    def _drop_oldest(self) -> None:
        """Keep only the whole texts within the newest `capacity` tokens (the text ends with
        END, so the cut always finds one)."""
        cut = self.text.index(END, len(self.text) - self.capacity) + 1
        self.base += cut
        self.text = self.text[cut:]
        self.after = {}
        self._index(0)
