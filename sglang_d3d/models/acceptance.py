"""What a drafter's held-out evaluation measured, kept beside its checkpoint (acceptance.json).

The adaptive controller (engine/adaptive.py) starts from these per-draft acceptance rates
instead of a flat 0.5. A flat prior makes this project's drafter look worse than plain
decoding before any speculative cycle has run (its first draft is right almost always, 0.5
says half the time), so a controller whose cycle times were calibrated at start-up would
never try speculating at all.
"""

from __future__ import annotations

import json
from pathlib import Path

ACCEPTANCE = "acceptance.json"


def write_acceptance(folder: Path, eval_row: dict) -> None:
    """eval_row: the trainer's held-out evaluation (step, by_position, num_blocks)."""
    keep = {k: eval_row[k] for k in ("step", "accept_len", "by_position", "num_blocks") if k in eval_row}
    (Path(folder) / ACCEPTANCE).write_text(json.dumps(keep, indent=2) + "\n")


def read_accept_prior(folder: Path) -> tuple[float, ...]:
    """Conditional acceptance rates per draft position, or () where nothing was recorded."""
    path = Path(folder) / ACCEPTANCE
    if not path.exists():
        return ()
    try:
        raw = json.loads(path.read_text())
        return conditional_rates([float(p) for p in raw["by_position"]], int(raw["num_blocks"]))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a held-out evaluation record (needs by_position and "
                         f"num_blocks; delete the file to run without it): {e!r}") from None


def conditional_rates(by_position: list[float], num_blocks: int) -> tuple[float, ...]:
    """by_position[i] = P(drafts 1..i+1 all accepted), over `num_blocks` blocks ->
    P(draft i+1 accepted | drafts 1..i accepted), each with a +1/+2 prior on the counts so a
    tail position that no block reached reads 0.5 rather than 0/0."""
    rates, reached = [], float(num_blocks)
    for p in by_position:
        accepted = p * num_blocks
        rates.append((accepted + 1) / (reached + 2))
        reached = accepted
    return tuple(round(r, 4) for r in rates)
