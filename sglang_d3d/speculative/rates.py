"""A running tokens-per-second estimate, shared by the embedded engine's copy arms and the SGLang
worker's plan per load (both measure ways of running a cycle and pick the faster)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rate:
    """Tokens (per row) and seconds of one way's cycles, older ones weighed down by `decay`."""

    tokens: float = 0.0
    seconds: float = 0.0
    cycles: int = 0

    def add(self, tokens: float, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.cycles += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
