"""System programs some tests need (the Debian `prometheus` package's prometheus and promtool):
where one is missing the test is skipped with the package named, except under CI (`CI=true`),
where it fails, so CI never passes without them."""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str, package: str = "prometheus") -> str:
    """The program's path; a skip (a failure under CI) naming its package when it is missing."""
    path = shutil.which(tool)
    if path is not None:
        return path
    why = (f"{tool} missing: install the Debian package `{package}` (`make test` does, where it "
           "runs as root with apt-get)")
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{why}; CI requires it")
    pytest.skip(why)
