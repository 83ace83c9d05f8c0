"""Import shims that let sglang 0.5.23 import and run on the CPU torch build, in test processes.

Two packages on sglang's import path cannot be installed in a CPU venv:

- `torchvision`: PyPI ships only the CUDA build; its C extension fails to load against CPU torch,
  and then `import transformers` fails in *every* process of the venv. sglang needs it only for
  multimodal preprocessing (`torchvision.transforms`), never on a text model's path.
- `sgl_kernel`: PyPI ships only the CUDA build. With SGLANG_USE_CPU_ENGINE=1 sglang imports ~60
  names from it at module level (kernel entry points, `scalar_type.scalar_types`).

Both are served by a meta-path finder as placeholder modules: any attribute resolves (so module
level imports succeed), and *calling* anything raises NotImplementedError naming the op, so a
missing kernel is reported exactly instead of silently mis-computing. `kernel_fallbacks` then
replaces the few sgl_kernel entry points that do run with pure-torch versions.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

CALLED: list[str] = []  # placeholder ops that were called (for the report of blocking ops)


class Placeholder:
    """Stands for a missing object: attributes chain, calls raise with the dotted name."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return Placeholder(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        CALLED.append(self._name)
        raise NotImplementedError(f"{self._name} is not available on CPU (no fallback installed)")

    def __repr__(self) -> str:
        return f"<placeholder {self._name}>"


class InterpolationMode(enum.Enum):
    """Same members as torchvision's enum: sglang builds dicts keyed by them at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class PlaceholderModule(types.ModuleType):
    overrides: dict[str, object] = {}

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        full = f"{self.__name__}.{key}"
        if full in self.overrides:
            return self.overrides[full]
        return Placeholder(full)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = PlaceholderModule(spec.name)
        m.__path__ = []
        # A version lets transformers' availability probes parse it; 0.0.0 keeps it from
        # choosing a torchvision-backed image processor.
        m.__version__ = "0.0.0"
        if spec.name.startswith("torchvision"):
            m.InterpolationMode = InterpolationMode
        return m

    def exec_module(self, module) -> None:
        pass


def _missing(root: str) -> bool:
    """True when `root` cannot be imported for real (absent, or a CUDA build on CPU torch)."""
    if importlib.util.find_spec(root) is None:
        return True
    try:
        __import__(root)
        return False
    except Exception:  # noqa: BLE001 - a broken CUDA wheel raises anything
        for key in [k for k in sys.modules if k == root or k.startswith(root + ".")]:
            del sys.modules[key]
        return True


def _pin_transformers_without_torchvision() -> None:
    """transformers caches (lru_cache) whether torchvision is available; asking it before the
    placeholder exists pins "no" for this process, so transformers itself (image processors,
    in any other test of the session) never picks up the placeholder that sglang imports."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()


def install() -> tuple[str, ...]:
    """Serve placeholders for the packages that are missing. -> their names. Idempotent."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return next(f.roots for f in sys.meta_path if isinstance(f, _Finder))
    roots = tuple(r for r in ("torchvision", "sgl_kernel") if _missing(r))
    if "torchvision" in roots:
        _pin_transformers_without_torchvision()
    if roots:
        sys.meta_path.insert(0, _Finder(roots))
    return roots
