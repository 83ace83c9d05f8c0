"""What every benchmark JSON records about its run: the CPU, the weight format, the commit and
the command, so a figure can be traced to the machine and code that produced it.

    out = {**run_info(weights="q4_1"), "results": ...}   # the four fields at the top level
"""
from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from pathlib import Path

from sglang_d3d.models.cpu_kernels import cpuinfo

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """lscpu's model name, with family and model where /proc/cpuinfo gives them."""
    fields = cpuinfo()
    name = fields.get("model name", platform.processor() or platform.machine())
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def commit() -> str:
    """The checkout's commit, with "+dirty" where tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def in_repo(path: str) -> str:
    """An absolute path inside the checkout as relative to it (results name no machine's
    folders); anything else as given."""
    if not Path(path).is_absolute():
        return path
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


def command(argv: list[str] | None = None) -> str:
    """The command line as typed (python and the script's path relative to the repo)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = in_repo(argv[0])
    return "python " + shlex.join(argv) if argv and argv[0].endswith(".py") else shlex.join(argv)


def run_info(weights: str, argv: list[str] | None = None) -> dict:
    """The four fields every results JSON carries: cpu, weights, commit, command."""
    return {"cpu": cpu_model(), "weights": weights, "commit": commit(), "command": command(argv)}
