"""Mixed precision for training: a low-precision frozen target, fp32 master weights.

With the target in bf16 (the default on GPUs) the trainable tensors (deltas, mask embedding)
are kept in fp32, so AdamW's small updates are not rounded away, and every forward runs under
autocast in bf16, so the matmuls still run at bf16 speed. An fp32 target needs neither.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # the target's dtype: what the matmuls run in
    device_type: str  # "cuda" | "cpu"

    @classmethod
    def for_target(cls, dtype: torch.dtype, device: str) -> Precision:
        return cls(dtype, torch.device(device).type)

    @property
    def mixed(self) -> bool:
        return self.compute in LOW

    def autocast(self):
        """Forward passes in the compute dtype (a no-op context for an fp32 target)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def keep_masters(self, params: list[torch.nn.Parameter]) -> None:
        """Trainable tensors to fp32 in place (the same Parameter objects, so the modules that
        hold them and the optimiser see the fp32 copy)."""
        if self.mixed:
            for p in params:
                p.data = p.data.float()
