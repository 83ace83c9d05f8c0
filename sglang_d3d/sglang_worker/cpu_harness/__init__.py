"""CPU test harness for running sglang 0.5.23 itself (scheduler, model runner, radix cache) on
the CPU torch build. Test processes only: production GPU installs have the real packages.

`install()` sets SGLANG_USE_CPU_ENGINE=1 (sglang's CPU code paths), serves placeholder modules
for the packages that have no CPU wheel (shims.py) and installs pure-torch versions of the
sgl_kernel ops that sglang calls on the paths we run (kernel_fallbacks.py).
`subprocess_env()` is the environment that makes sglang's own subprocesses do the same.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"


def install() -> tuple[str, ...]:
    """-> the packages replaced by placeholders."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang_d3d.sglang_worker.cpu_harness import kernel_fallbacks, shims

    roots = shims.install()
    kernel_fallbacks.install()
    return roots


def subprocess_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for processes that import sglang (they load site/sitecustomize.py)."""
    env = dict(os.environ if base is None else base)
    parts = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env
