"""The plan per load: for each batch size, speculate (draft + verify, or one fused forward) or
decode plainly, by measurement, so that speculation never makes SGLang slower than SGLang alone.

Each batch-size bucket (powers of two) keeps a running rate, tokens per second, for each kind
of cycle it may run (`kinds`). A bucket first tries each kind `probe` times, then runs the
fastest one and re-tries the others in turn, each for `probe` cycles every `explore_every`
cycles (the rates move with the text and the machine's load). Tokens are what SGLang committed, read from its requests at the next cycle
(`output_ids` lengths): no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_d3d.speculative.rates import Rate

SPEC = "spec"
PLAIN = "plain"
FUSED = "fused"  # verify and next block's drafts in one forward (fused_cycle.py)
# What SGLANG_D3D_MODE=auto chooses among, per batch size, by measurement (docs/sglang.md:
# with fused cycles among them too, bench_sglang.py was no faster; the worker drops what its
# attention backend cannot run).
AUTO_KINDS = (SPEC, PLAIN)


def bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class Bucket:
    rates: dict[str, Rate]
    cycles: int = 0
    exploring: int = 0  # cycles of `other` still to run
    other: str = ""
    explored: int = 0  # re-tries started, to take the other kinds in turn


@dataclass
class LoadPlan:
    probe: int = 4
    explore_every: int = 64
    decay: float = 0.95
    kinds: tuple[str, ...] = (SPEC, PLAIN)
    buckets: dict[int, Bucket] = field(default_factory=dict)

    def _bucket(self, batch_size: int) -> Bucket:
        return self.buckets.setdefault(bucket(batch_size),
                                       Bucket({k: Rate() for k in self.kinds}))

    def choose(self, batch_size: int) -> str:
        b = self._bucket(batch_size)
        b.cycles += 1
        for kind in self.kinds:
            if b.rates[kind].cycles < self.probe:
                return kind
        best = max(self.kinds, key=lambda k: b.rates[k].per_second)
        if b.exploring > 0:
            b.exploring -= 1
            return b.other
        others = [k for k in self.kinds if k != best]
        if others and b.cycles % self.explore_every == 0:
            b.other = others[b.explored % len(others)]
            b.explored += 1
            b.exploring = self.probe - 1
            return b.other
        return best

    def record(self, batch_size: int, kind: str, tokens: int, seconds: float) -> None:
        rate = self._bucket(batch_size).rates.get(kind)
        if rate is not None:  # a kind this plan does not choose among is not kept
            rate.add(tokens, seconds, self.decay)

    def summary(self) -> dict[int, dict[str, float]]:
        """Per bucket: each kind's tokens/s so far."""
        return {k: {kind: round(r.per_second, 2) for kind, r in b.rates.items()}
                for k, b in sorted(self.buckets.items())}
