"""Whether a cycle whose rows all found copies verifies them, with other texts' guesses beside
them (`copy_guesses`) or alone, or runs the controller's plan instead: chosen by what each
way measures on this machine, per batch size.

The guesses add tokens a cycle and cost verify width, and what a token of width costs depends
on the hardware: simulated offline with a token at 1.2% of a plain step they paid 9% on GSM8K;
on this project's CPU in sitting 19 (3-4% a token: a 16-token verify 1.4-1.6 plain steps) they
ran level, -3% to +6% in eight side-by-side runs (benchmarks/results/README.md). And a cycle of
copies at batch 4 costs about two plain steps there, so its rows must keep more than a token
each beyond plain decoding's to pay. So the ways of copying run, alternating, until each has
`warmup` cycles of a batch size; then the fastest (tokens emitted a second, over recent
cycles) serves, or the plan where the controller expects more of it, and every
`explore_every`-th such cycle tries another way, so a change of load or text is seen.
Outputs are the same whichever way runs (the target verifies them all).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArmsConfig:
    warmup: int = 8  # cycles each way gets, alternating, before another is preferred
    explore_every: int = 8  # then every this many cycles of copies, one tries the other way
    decay: float = 0.98  # the weight of a way's past cycles at each new cycle of it

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.explore_every < 2 or not 0.0 < self.decay <= 1.0:
            raise ValueError(f"need warmup >= 1, explore_every >= 2, decay in (0, 1]: {self}")


@dataclass
class Rate:
    """Tokens and seconds of one way's cycles, older ones weighed down by `decay`."""

    tokens: float = 0.0
    seconds: float = 0.0
    cycles: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.cycles += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class CopyArms:
    def __init__(self, guesses: bool = True, cfg: ArmsConfig = ArmsConfig()) -> None:
        self.cfg = cfg
        self.ways = (True, False) if guesses else (False,)  # guesses beside the copies or not
        self.rates: dict[tuple[int, bool], Rate] = {}  # (batch, guesses on) -> its cycles
        self.turns: dict[int, int] = {}  # batch -> cycles whose rows all had copies

    def choose(self, batch: int, plan_rate: float | None = None) -> bool | None:
        """For a cycle at `batch` whose rows all found copies: verify them with guesses beside
        (True) or alone (False), or None: run the plan, which the controller expects to
        emit `plan_rate` tokens a second (None: no controller, copies always)."""
        turn = self.turns.get(batch, 0)
        self.turns[batch] = turn + 1
        young = [w for w in self.ways if self.rate(batch, w).cycles < self.cfg.warmup]
        if young:  # alternate, guesses first
            return min(young, key=lambda w: self.rate(batch, w).cycles)
        options: list[bool | None] = sorted(self.ways, key=lambda w: -self.rate(batch, w).per_second)
        if plan_rate is not None and self.rate(batch, options[0]).per_second < plan_rate:
            options.insert(0, None)
        if len(options) > 1 and turn % self.cfg.explore_every == 0:
            return options[1 + (turn // self.cfg.explore_every) % (len(options) - 1)]
        return options[0]

    def observe(self, batch: int, guesses: bool, tokens: int, seconds: float) -> None:
        """A cycle of copies at `batch` emitted `tokens` in all in `seconds`."""
        self.rate(batch, guesses).add(tokens, seconds, self.cfg.decay)

    def rate(self, batch: int, guesses: bool) -> Rate:
        return self.rates.setdefault((batch, guesses), Rate())
