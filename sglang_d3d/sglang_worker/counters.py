"""What the worker does per cycle, counted where it happens: target passes, attention-metadata
plans (SGLang's backend call, wrapped), device-to-host copies the worker makes, tokens the
drafter had to prefill, accepted tokens, and the drafter's own bytes.

With SGLANG_D3D_COUNTERS_FILE set, the totals are written there as JSON after every cycle
(benchmarks/bench_sglang.py and the counter tests read them from SGLang's scheduler process);
otherwise they stay in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_ENV = "SGLANG_D3D_COUNTERS_FILE"


@dataclass
class Counters:
    cycles: int = 0  # speculative cycles (one forward_batch_generation on a decode batch)
    plain_steps: int = 0  # cycles decoded plainly (the plan chose no drafts for the load)
    plain_requests: int = 0  # sum over plain cycles of the batch size
    fused_steps: int = 0  # cycles that verified and drafted in one forward (fused_cycle.py)
    requests_cycled: int = 0  # sum over cycles of the batch size
    target_passes: int = 0
    metadata_plans: int = 0
    host_copies: int = 0
    drafter_passes: int = 0
    drafter_prefill_tokens: int = 0  # clean tokens a drafter pass computed (0: it reads the pool)
    draft_s: float = 0.0  # host time in draft passes (on a GPU: launch time, not kernels)
    verify_s: float = 0.0  # host time in the verify pass and acceptance
    target_s: float = 0.0  # ... of which SGLang's forward (its input built before)
    cycle_s: float = 0.0  # host time in whole cycles
    tokens_emitted: int = 0  # tokens committed by the cycles (accepted drafts + target's token)
    drafter_bytes: int = 0  # the drafter's own tensors on the target's device
    drafter_shares_target: bool = False
    # Drafter layer tensors on the target's device that are not SGLang's own storage
    # (`layer_copies`): 0 where the drafter shares the target.
    target_layer_copies: int = 0

    def write(self) -> None:
        path = os.environ.get(FILE_ENV)
        if not path:
            return
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)  # readers never see half a file


def count_calls(obj, name: str, counters: Counters, field: str) -> None:
    """Wrap obj.name so each call adds one to counters.field (SGLang's own method runs)."""
    inner = getattr(obj, name)

    def counted(*args, **kwargs):
        setattr(counters, field, getattr(counters, field) + 1)
        return inner(*args, **kwargs)

    setattr(obj, name, counted)


def layer_copies(drafter_layers, target_model) -> int:
    """How many of the drafter layers' frozen (non-delta) tensors live in storage that is not
    one of `target_model`'s parameters: copies of the target that the drafter holds."""
    theirs = {p.untyped_storage().data_ptr() for p in target_model.parameters()}
    return sum(1 for name, p in drafter_layers.named_parameters()
               if "delta_" not in name and p.untyped_storage().data_ptr() not in theirs)
