"""Which engine serves the requests: the embedded engine loop, or D3D inside SGLang (CUDA)."""

from __future__ import annotations

import importlib.util

from sglang_d3d.server.args import Backend
from sglang_d3d.server.engine_holder import EngineFactory


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine; the message says why and what to do."""


def check_backend(backend: Backend) -> None:
    """Fail fast, before the server starts listening, with a message a user can act on."""
    if backend is not Backend.SGLANG:
        return
    if importlib.util.find_spec("sglang") is None:
        raise BackendUnavailable(
            "--backend sglang needs SGLang: pip install '.[sglang]' in a clone of sglang-d3d "
            "(or use the default --backend embedded)"
        )
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "--backend sglang needs a CUDA GPU and none is visible; "
            "use --backend embedded to serve on CPU"
        )


def _embedded(cfg):
    from sglang_d3d.engine.factory import build_engine_loop

    return build_engine_loop(cfg)


def _sglang(cfg):
    check_backend(Backend.SGLANG)
    try:
        from sglang_d3d.sglang_worker.backend import build_engine_loop
    except ImportError as e:
        raise BackendUnavailable(f"the SGLang backend could not be imported: {e}") from e
    return build_engine_loop(cfg)


_FACTORIES: dict[Backend, EngineFactory] = {Backend.EMBEDDED: _embedded, Backend.SGLANG: _sglang}


def engine_factory(backend: Backend) -> EngineFactory:
    return _FACTORIES[backend]
