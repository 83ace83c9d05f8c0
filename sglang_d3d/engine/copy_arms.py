"""Whether a cycle of copies verifies other texts' guesses beside its copies (`copy_guesses`),
chosen by what each way measures on this machine, per batch size.

The guesses add tokens a cycle and cost verify width, and what a token of width costs depends
on the hardware: offline on one CPU of this project's (a 16-token verify 18% dearer than a
1-token one) they paid 9% on GSM8K; on a faster one (56% dearer) they ran level, a few per
cent either way in three runs (benchmarks/results/README.md, sitting 19). So both ways run,
alternating, until each has `warmup` cycles of a batch size; then the faster (tokens emitted a
second, over recent cycles) serves, and every `explore_every`-th cycle tries the other, so a
change of load or text is seen. Outputs are the same either way (the target verifies both).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArmsConfig:
    warmup: int = 16  # cycles each way gets, alternating, before either is preferred
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
    def __init__(self, cfg: ArmsConfig = ArmsConfig()) -> None:
        self.cfg = cfg
        self.rates: dict[tuple[int, bool], Rate] = {}  # (batch, guesses on) -> its cycles
        self.turns: dict[int, int] = {}  # batch -> cycles of copies chosen so far

    def choose(self, batch: int) -> bool:
        """Whether this batch's next cycle of copies verifies guesses beside its copies."""
        on, off = self.rate(batch, True), self.rate(batch, False)
        turn = self.turns.get(batch, 0)
        self.turns[batch] = turn + 1
        if min(on.cycles, off.cycles) < self.cfg.warmup:
            return on.cycles <= off.cycles  # alternate, guesses first
        faster = on.per_second >= off.per_second
        return faster != (turn % self.cfg.explore_every == 0)

    def observe(self, batch: int, guesses: bool, tokens: int, seconds: float) -> None:
        """A cycle of copies at `batch` emitted `tokens` in all in `seconds`."""
        self.rate(batch, guesses).add(tokens, seconds, self.cfg.decay)

    def rate(self, batch: int, guesses: bool) -> Rate:
        return self.rates.setdefault((batch, guesses), Rate())
