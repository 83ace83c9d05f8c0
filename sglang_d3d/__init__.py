"""D3D speculative decoding: engine, SGLang worker, drafter training (see docs/design.md)."""

from pathlib import Path as _Path

# server/ and benchmarks/ are top-level folders of the checkout; installs put them inside this
# package (pyproject.toml package-dir: sglang_d3d.server, sglang_d3d.benchmarks). A checkout used
# without installing it (PYTHONPATH=.) gets the same names by searching its root for subpackages.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "server" / "__init__.py").is_file():
    __path__.append(str(_root))
