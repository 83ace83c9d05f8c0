"""y = x @ W.T + b with W stored as int8 (one scale per output row), for the drafter's passes
on CPU through fbgemm's dynamic-quantised GEMM (activations quantised per call).

Why: a drafter pass is a few dozen rows through every weight, so it is bound by reading the
weights. int8 reads a quarter of fp32's bytes. Measured on this project's CPU (AMD EPYC,
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
from dataclasses import dataclass

import torch

# Activations use all 8 bits (unsigned, per call). Weights use 8 bits where fbgemm's int8
# product sums in int32 (AVX-512 VNNI, this project's CPU) and 7 (+-63) where it adds two
# u8 x s8 products in int16 (AVX2's vpmaddubsw: 255 * 127 * 2 would saturate, 255 * 63 * 2 =
# 32130 fits); `weight_levels` tells which by trying the worst case. Measured here, drafts
# accepted per block of 8 on the target's answers (benchmarks/bench_int8_accuracy.py; fp32
# 2.08 GSM8K / 1.62 MT-Bench): 8-bit weights with 7-bit activations 1.95 / 1.44 (the first
# int8 setting), 7-bit weights with 8-bit activations 1.97 / 1.51, 8 and 8 2.00 / 1.57.
FULL_LEVELS, AVX2_LEVELS = 127, 63


def quantize_rows(w: torch.Tensor, levels: int = FULL_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8 in [-levels, levels], scale [N] float64) with
    w ~= q * scale[:, None], symmetric per row; an all-zero row gets scale 1 (its q is 0)."""
    w = w.detach().float()  # the LM head in float64 would be a 226 MB temporary
    amax = w.abs().amax(dim=1)  # [N]
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-levels, levels).to(torch.int8)
    return q, scale.double()


def sums_in_int32(product) -> bool:
    """Whether `product(x, w)` (an int8 GEMM of 8-bit activations and 8-bit weights) is exact
    on the worst case for int16 pair sums: every activation and every weight at the top of
    its range, same sign."""
    w, x = torch.ones(4, 64), torch.full((2, 64), 5.0)
    return bool(torch.allclose(product(x, w), x @ w.T, rtol=1e-3))


@functools.lru_cache(maxsize=1)
def weight_levels() -> int:
    """The weight levels this machine's fbgemm can take with 8-bit activations."""
    def product(x, w):
        return Int8Linear(w, None, Int8Setting(FULL_LEVELS))(x)
    return FULL_LEVELS if sums_in_int32(product) else AVX2_LEVELS


@dataclass(frozen=True)
class Int8Setting:
    """How an int8 copy quantises. The default is what the service uses; the others are
    there for benchmarks/bench_int8_accuracy.py to compare."""

    levels: int | None = None  # weight levels; None: `weight_levels()`, the most this machine takes
    reduce_range: bool = False  # True: 7-bit activations (the first int8 setting)


class Int8Linear:
    """One (possibly fused) projection in int8, prepacked for fbgemm. Same call as
    cpu_linear.PackedLinear: x [..., K] -> [..., N] float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 setting: Int8Setting = Int8Setting()) -> None:
        self.reduce_range = setting.reduce_range
        levels = weight_levels() if setting.levels is None else setting.levels
        q, scale = quantize_rows(weight, levels)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch marks quantized tensors deprecated (pytorch/pytorch#184982) but keeps fbgemm's
            # kernels in the pinned build; `available()` probes them before any use.
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, scale, zero, 0)
        b = None if bias is None else bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack(qw, b)
        self.out_features = q.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous().float()  # [M, K]
        y = torch.ops.quantized.linear_dynamic(flat, self.packed, self.reduce_range)  # [M, N]
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
