"""y = x @ W.T + b for the target's inference passes on CPU, through the fastest GEMM we have.

Why not `F.linear`: the torch CPU build multiplies with MKL, which on this project's AMD CPU
(Zen 4) is far from the hardware. Measured in the target's decode step (30 layers + LM head,
fused projections, 200-token context):
    1 row, 1 thread:   MKL 55 ms, oneDNN 50 ms, OpenBLAS (numpy's) GEMV over W.T 36 ms;
    1 row, 2 threads:  MKL 58 ms, oneDNN 33 ms, OpenBLAS (1 thread) 35 ms;
    16 rows, 1 thread: MKL 95 ms, oneDNN with pre-packed weights 53 ms (GEMMs alone).
So one row on one thread goes to OpenBLAS' GEMV, everything else to oneDNN with the weight
reordered once into its blocked layout. Other dtypes or devices, gradients, or a build
without these kernels fall back to `F.linear`. Results equal `F.linear`'s up to float
rounding (another summation order), as MKL's own 1-row and 16-row kernels already differ.
Memory: two extra copies of each weight (oneDNN's layout and W.T), CPU only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Kernels:
    """Which fast paths this process has (probed once, see `probe`)."""

    onednn: bool
    openblas: object | None  # threadpoolctl controller of numpy's OpenBLAS, or None


class PackedLinear:
    """One (possibly fused) projection. weight [N, K] is shared, not copied; `packed` is
    oneDNN's copy in its blocked layout (None: not packed)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        fast = weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.packed = None
        if fast and kernels.onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
        self._blas = kernels.openblas if fast else None
        # [K, N] contiguous: OpenBLAS' GEMV reads this layout ~1.4x faster than [N, K].
        self._wt_np = self.weight.T.contiguous().numpy() if self._blas is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        if self._wt_np is not None and x.numel() == x.shape[-1] and not x.requires_grad:
            if torch.get_num_threads() == 1:  # with more threads oneDNN's GEMV is as fast
                return self._gemv(x)
        if self.packed is not None and not x.requires_grad:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.from_numpy(x.reshape(1, -1).contiguous().numpy() @ self._wt_np)  # [1, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], -1)


def fuse(linears: list[torch.nn.Linear], kernels: Kernels) -> PackedLinear:
    """Several projections of the same input as one: outputs concatenated in order."""
    return PackedLinear(*fused_weight(linears), kernels)


def fused_weight(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights [sum N_i, K] and bias (None: no projection has one) of several projections
    of the same input, outputs concatenated in order; one projection's own, not copied."""
    if len(linears) == 1:
        return linears[0].weight, linears[0].bias
    w = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    if all(x is None for x in biases):
        return w, None
    b = torch.cat([
        m.weight.new_zeros(m.out_features) if x is None else x.detach()
        for m, x in zip(linears, biases)
    ])
    return w, b


@functools.lru_cache(maxsize=1)
def probe() -> Kernels:
    """Which kernels work here, checked on a small product against `F.linear`."""
    return Kernels(onednn=_onednn_works(), openblas=_openblas_controller())


def _onednn_works() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-4))
    except (RuntimeError, AttributeError):
        return False


def _openblas_controller():
    try:
        import numpy  # noqa: F401 - loads numpy's OpenBLAS so threadpoolctl can find it
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    libs = ThreadpoolController().select(internal_api="openblas").lib_controllers
    if not libs:
        return None
    # One thread, always: a GEMV is bound by memory, which one core nearly saturates, and
    # OpenBLAS' pthreads spinning next to torch's OpenMP threads on the same cores made a
    # 2-thread decode step 5x slower (measured). OpenBLAS has one process-wide setting.
    libs[0].set_num_threads(1)
    return libs[0]


