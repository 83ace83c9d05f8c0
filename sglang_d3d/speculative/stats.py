"""Speculation statistics: one `CycleStats` per verify cycle, folded into `RequestStats`.

The engine fills these; the logger, the CLI's JSON output and the Prometheus recorder
(server/metrics.py) all read from them, so every surface reports the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# What a cycle verified: nothing (target-only decoding), a run copied from text (no drafter
# pass), or the drafter's block. Their yields and costs differ by kind (a cycle of copies skips
# the drafter's pass), so the kinds are tallied apart to show where decoding time goes.
KINDS = ("plain", "copy", "draft")


@dataclass
class CycleStats:
    """One verify cycle of one request."""

    num_drafts: int  # draft positions sent to the target (a token tree: its depth; 0 in ar mode)
    num_accepted: int  # drafts the target accepted (the bonus/correction token not included)
    branch_hit: bool | None  # async only: did a pre-drafted branch match? None otherwise
    draft_time: float  # seconds the drafter spent on this cycle's drafting work
    verify_time: float  # seconds of the target forward pass
    cycle_time: float  # wall seconds from cycle start to tokens emitted
    overlap_time: float  # seconds during which drafter and target ran at the same time
    tree_nodes: int = 0  # drafts sent as a token tree (speculative/tree.py); 0: a chain
    copied: bool = False  # drafts copied from the request's own text, no drafter pass (lookup.py)

    @property
    def accepted_length(self) -> int:
        """Tokens gained this cycle: accepted drafts plus the target's own token."""
        return self.num_accepted + 1

    @property
    def kind(self) -> str:
        """One of KINDS."""
        if self.copied:
            return "copy"
        return "draft" if self.num_drafts else "plain"


@dataclass
class RequestStats:
    """Per-request aggregate. Lists are per cycle so a timeline can be rebuilt."""

    mode: str = "async"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: cycles accepting draft i
    drafts_per_position: list[int] = field(default_factory=list)  # [i]: cycles that proposed draft i
    branch_hits: int = 0
    branch_misses: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    cycle_time: float = 0.0
    overlap_time: float = 0.0
    prefill_time: float = 0.0
    queue_time: float = 0.0  # submit -> first scheduled (prefill start)
    fallbacks: int = 0  # cycles where the drafter failed and the engine carried on without it
    # per cycle kind (KINDS): cycles, tokens gained, and wall seconds
    kind_cycles: dict[str, int] = field(default_factory=dict)
    kind_tokens: dict[str, int] = field(default_factory=dict)
    kind_seconds: dict[str, float] = field(default_factory=dict)

    def add_cycle(self, c: CycleStats) -> None:
        self.accepted_lengths.append(c.accepted_length)
        _bump(self.drafts_per_position, c.num_drafts)
        _bump(self.accepted_per_position, c.num_accepted)
        if c.branch_hit is True:
            self.branch_hits += 1
        elif c.branch_hit is False:
            self.branch_misses += 1
        self.draft_time += c.draft_time
        self.verify_time += c.verify_time
        self.cycle_time += c.cycle_time
        self.overlap_time += c.overlap_time
        k = c.kind
        self.kind_cycles[k] = self.kind_cycles.get(k, 0) + 1
        self.kind_tokens[k] = self.kind_tokens.get(k, 0) + c.accepted_length
        self.kind_seconds[k] = self.kind_seconds.get(k, 0.0) + c.cycle_time

    @property
    def num_cycles(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(1, self.num_cycles)

    @property
    def branch_hit_rate(self) -> float | None:
        total = self.branch_hits + self.branch_misses
        return self.branch_hits / total if total else None

    @property
    def copy_cycles(self) -> int:
        """Cycles that verified a run copied from the text, no drafter pass."""
        return self.kind_cycles.get("copy", 0)

    @property
    def overlap_fraction(self) -> float:
        return self.overlap_time / self.cycle_time if self.cycle_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            num_cycles=self.num_cycles,
            mean_accepted_length=self.mean_accepted_length,
            branch_hit_rate=self.branch_hit_rate,
            overlap_fraction=self.overlap_fraction,
            copy_cycles=self.copy_cycles,
        )
        return d


def kind_summary(cycles: dict[str, int], tokens: dict[str, int],
                 seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per cycle kind, from the tallies of any number of requests: its share of the cycles and
    of the decoding time, tokens per cycle, ms per cycle and tokens per second of its cycles
    (so a kind that yields more per cycle but costs more per cycle can be told from one that
    pays). Kinds that never ran are left out."""
    all_cycles, all_seconds = sum(cycles.values()), sum(seconds.values())
    out = {}
    for k in KINDS:
        n, t = cycles.get(k, 0), seconds.get(k, 0.0)
        if not n:
            continue
        out[k] = {
            "cycle_share": n / all_cycles,
            "time_share": t / all_seconds if all_seconds > 0 else 0.0,
            "tokens_per_cycle": tokens.get(k, 0) / n,
            "ms_per_cycle": 1e3 * t / n,
            "tokens_per_s": tokens.get(k, 0) / t if t > 0 else 0.0,
        }
    return out


def _bump(counts: list[int], upto: int) -> None:
    """Add one to counts[0:upto], growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1
