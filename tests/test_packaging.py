"""pyproject.toml lists every package of the tree, and installs server/ and benchmarks/ inside
sglang_d3d: nothing named `server` at the top of site-packages."""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed_and_all_sit_under_sglang_d3d():
    cfg = _setuptools()
    mapped = cfg["package-dir"]
    assert mapped == {"sglang_d3d.server": "server", "sglang_d3d.benchmarks": "benchmarks"}
    found = set(find_packages(str(ROOT), include=["sglang_d3d", "sglang_d3d.*"]))
    assert set(cfg["packages"]) == found | set(mapped)
    assert all(p.split(".")[0] == "sglang_d3d" for p in cfg["packages"])
    for folder in mapped.values():
        assert (ROOT / folder / "__init__.py").is_file()


def test_a_checkout_imports_the_mapped_packages_under_the_same_names():
    import sglang_d3d.benchmarks.bench_serving as bench
    import sglang_d3d.server.main as main

    assert Path(main.__file__).resolve() == ROOT / "server" / "main.py"
    assert Path(bench.__file__).resolve() == ROOT / "benchmarks" / "bench_serving.py"
