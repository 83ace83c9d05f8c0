"""The layering docs/design.md states, as imported: the SGLang worker and the embedded engine sit
side by side over speculative/ and models/, so the worker imports nothing from engine/."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "sglang_d3d"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _importers(folder: str, banned: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted((PKG / folder).rglob("*.py")):
        bad = sorted(m for m in _imports(path) if m == banned or m.startswith(banned + "."))
        if bad:
            found[str(path.relative_to(PKG))] = bad
    return found


def test_the_scan_sees_imports_at_any_depth(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef f():\n    from sglang_d3d.engine import engine\n")
    assert "sglang_d3d.engine.engine" in _imports(f) and "os" in _imports(f)


def test_sglang_worker_imports_nothing_from_the_engine():
    assert list((PKG / "sglang_worker").rglob("*.py"))  # the scan looks at real files
    assert _importers("sglang_worker", "sglang_d3d.engine") == {}


def test_engine_imports_nothing_from_the_sglang_worker():
    assert _importers("engine", "sglang_d3d.sglang_worker") == {}


def test_speculative_and_models_import_no_host():
    for folder in ("speculative", "models"):
        for host in ("sglang_d3d.engine", "sglang_d3d.sglang_worker", "sglang_d3d.server"):
            assert _importers(folder, host) == {}, (folder, host)
