"""The plan per load: for each batch size, speculate (draft + verify) or decode plainly, by
measurement, so that speculation never makes SGLang slower than SGLang alone.

Each batch-size bucket (powers of two) keeps a running rate, tokens per second, for both kinds
of cycle. A bucket first tries each kind `probe` times, then runs the faster one and re-tries
the other for `probe` cycles every `explore_every` cycles (the rates move with the text and the
machine's load). Tokens are what SGLang committed, read from its requests at the next cycle
(`output_ids` lengths): no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_d3d.speculative.rates import Rate

SPEC = "spec"
PLAIN = "plain"


def bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class Bucket:
    rates: dict[str, Rate] = field(default_factory=lambda: {SPEC: Rate(), PLAIN: Rate()})
    cycles: int = 0
    exploring: int = 0  # cycles of the other kind still to run


@dataclass
class LoadPlan:
    probe: int = 4
    explore_every: int = 64
    decay: float = 0.95
    buckets: dict[int, Bucket] = field(default_factory=dict)

    def choose(self, batch_size: int) -> str:
        b = self.buckets.setdefault(bucket(batch_size), Bucket())
        b.cycles += 1
        for kind in (SPEC, PLAIN):
            if b.rates[kind].cycles < self.probe:
                return kind
        best = max((SPEC, PLAIN), key=lambda k: b.rates[k].per_second)
        other = PLAIN if best == SPEC else SPEC
        if b.exploring > 0:
            b.exploring -= 1
            return other
        if b.cycles % self.explore_every == 0:
            b.exploring = self.probe - 1
            return other
        return best

    def record(self, batch_size: int, kind: str, tokens: int, seconds: float) -> None:
        b = self.buckets.setdefault(bucket(batch_size), Bucket())
        b.rates[kind].add(tokens, seconds, self.decay)

    def summary(self) -> dict[int, dict[str, float]]:
        """Per bucket: each kind's tokens/s so far."""
        return {k: {kind: round(r.per_second, 2) for kind, r in b.rates.items()}
                for k, b in sorted(self.buckets.items())}
