"""y = x @ W.T + b with W stored as int8 (one scale per output row), for the drafter's passes
on CPU through fbgemm's dynamic-quantised GEMM (activations quantised per call).

Why: a drafter pass is a few dozen rows through every weight, so it is bound by reading the
weights. int8 reads a quarter of fp32's bytes. Measured on this project's CPU (AMD Zen 4, AVX2,
1 thread; fp32 = the oneDNN path of models/cpu_linear.py; benchmarks/results/README.md):
    11 rows x [3072, 576]:  fp32 373 us, int8 118 us
    11 rows x [49152, 576] (LM head): fp32 8.7 ms, int8 2.6 ms
Why only the drafter: the target's outputs are the service's outputs and stay in full
precision. A drafter in int8 only proposes; verification keeps the target's tokens, so int8
costs accepted length (measured), never correctness.
"""

from __future__ import annotations

import functools
import warnings

import torch


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float64) with w ~= q * scale[:, None],
    symmetric per row; an all-zero row gets scale 1 (its q is 0)."""
    w = w.detach().float()  # the LM head in float64 would be a 226 MB temporary
    amax = w.abs().amax(dim=1)  # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.double()


class Int8Linear:
    """One (possibly fused) projection in int8, prepacked for fbgemm. Same call as
    cpu_linear.PackedLinear: x [..., K] -> [..., N] float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scale = quantize_rows(weight)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch marks quantized tensors deprecated (its issue 184982) but keeps fbgemm's
            # kernels in the pinned build; `available()` probes them before any use.
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, scale, zero, 0)
        b = None if bias is None else bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack(qw, b)
        self.out_features = q.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous().float()  # [M, K]
        # reduce_range: 7-bit activations, so AVX2's u8 x s8 pair sums cannot saturate int16.
        y = torch.ops.quantized.linear_dynamic(flat, self.packed, True)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """fbgemm is in this torch build and agrees with F.linear on a small product."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        y = Int8Linear(w, None)(x)
        return bool(torch.allclose(y, x @ w.T, rtol=0.1, atol=0.1))
    except (RuntimeError, AttributeError):
        return False


def use_int8(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the drafter's passes run in int8 under `setting` (EngineConfig.draft_weights:
    auto, full, int8) for a drafter on `device` in `dtype`. int8 needs the CPU fast path
    (fp32 on a CPU, fbgemm present): asked for elsewhere, it is refused, not ignored."""
    here = torch.device(device).type == "cpu" and dtype == torch.float32 and available()
    if setting == "int8" and not here:
        raise ValueError(f"draft weights int8 need the drafter on a CPU in float32 with fbgemm "
                         f"(drafter on {device} in {dtype}); use 'auto' or 'full'")
    return setting == "int8" or (setting == "auto" and here)
