"""Pure-torch versions of the sgl_kernel ops that sglang calls on the CPU paths we run.

Filled in from what the end-to-end run actually calls (shims.CALLED lists any placeholder op
that was called without a fallback).
"""

from __future__ import annotations

from sglang_d3d.sglang_worker.cpu_harness.shims import PlaceholderModule

FALLBACKS: dict[str, object] = {}


def install() -> None:
    PlaceholderModule.overrides.update(FALLBACKS)
