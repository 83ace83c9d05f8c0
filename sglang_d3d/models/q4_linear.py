"""y = x @ W.T + b with W held as 4-bit blocks (a GGUF's Q4_1 weights), through torch's int4
weight-only CPU kernel (`aten._weight_int4pack_mm_for_cpu`, the one torchao's int4 CPU layout
calls).

Q4_1 stores each weight as d * q + m: q in [0, 15], one fp16 scale d and minimum m per block
of 32 inputs. The kernel computes w = (q - 8) * scale + zero per group of 32, so the same q
serve unchanged with scale = d and zero = m + 8 d. Its scales and zeros are bf16 (8-bit
significand against fp16's 11): rounding d and m + 8 d to bf16 moves each weight by at most
(15 * 2^-9 * |d| + 2^-9 * |m + 8 d|), a small fraction of the 4-bit step d itself
(benchmarks/bench_passes.py prints the measured error). That rounded weight is this runner's
weight everywhere: every pass, of any number of rows, reads the same bytes.

Precision: activations enter the kernel as bf16, the products sum in fp32 and come out as
bf16, returned as fp32; everything around the projections (norms, RoPE, attention, residual
stream, the LM head) stays fp32. Each output row depends on its own input row only, bitwise
(tested), so a token's logits do not depend on what else shares its pass.

Why this kernel. SmolLM2-135M's 30 layers' projections, each layer its own weights, 1 thread,
min of 7 runs on a shared machine (ms for 1 / 4 / 8 / 16 rows):
    fp32, cpu_linear.PackedLinear (the fp32 target's path)   43.5 / 63.8 / 71.2 / 83.0
    int4, bf16 activations (this)                            14.2 / 16.0 / 29.4 / 56.0
    int8 fbgemm, dynamic activations (int8_linear.py)        15.8 / 18.8 / 23.0 / 29.6
    int4, fp32 activations                                   209 at 1 row
    int4, fp16 activations (no AVX-512 FP16 here)            10-68x slower than fp32
fbgemm's int8 is as fast, but it scales activations per call, so a row's result depends on
the rows beside it, and it would requantise the file's weights; this kernel computes the
file's own 4-bit weights row by row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP = 32  # inputs per Q4_1 block, one kernel group
MID = 8  # the kernel's q offset: w = (q - MID) * scale + zero


@dataclass(frozen=True)
class Q4Blocks:
    """A weight [N, K] as Q4_1 blocks: q [N, K] uint8 in [0, 15], d and m [N, K / 32] fp16;
    weight = d * q + m per block."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, index: torch.Tensor) -> Q4Blocks:
        """The rows at `index` [N'] (a permutation moves whole rows: blocks run along K)."""
        return Q4Blocks(self.q[index], self.d[index], self.m[index])

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Several weights of the same input stacked along the output (fused projections)."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))

    def scales_zeros(self) -> torch.Tensor:
        """[K / 32, N, 2] bf16 (scale, zero) as the kernel reads them: d and m + 8 d."""
        d, m = self.d.float(), self.m.float()  # fp16 -> fp32 exact; m + 8 d exact in fp32
        return torch.stack([d.T, (m + MID * d).T], dim=-1).to(torch.bfloat16).contiguous()

    def dequantize(self, kernel: bool = True) -> torch.Tensor:
        """[N, K] fp32: the weight the kernel computes with (bf16 scale and zero), or
        (kernel=False) the file's own d * q + m."""
        q = self.q.float()
        if kernel:
            sz = self.scales_zeros().float()  # [G, N, 2]
            scale, zero = sz[..., 0].T, sz[..., 1].T  # [N, G]
            return (q - MID) * _per_input(scale) + _per_input(zero)
        return q * _per_input(self.d.float()) + _per_input(self.m.float())


def _per_input(x: torch.Tensor) -> torch.Tensor:
    """[N, G] per block -> [N, G * 32] per input."""
    return x.repeat_interleave(GROUP, dim=1)


class Q4Linear:
    """One (possibly fused) projection on 4-bit weights: x [..., K] -> [..., N] fp32. Same call
    as cpu_linear.PackedLinear, so the fused layers take either."""

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None = None) -> None:
        n, k = blocks.shape
        if k % GROUP:
            raise ValueError(f"4-bit weights need inputs in blocks of {GROUP}, not {k}")
        q = blocks.q.to(torch.int32).contiguous()  # [N, K] in [0, 15]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K / 2] uint8
        self.scales_zeros = blocks.scales_zeros()
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = n, k

    @property
    def nbytes(self) -> int:
        """Bytes a pass reads: the 4-bit weights and their bf16 scales and zeros."""
        return self.packed.numel() + self.scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        y = y.float()  # [M, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """This torch build has the int4 CPU kernel and it agrees with the dequantised product."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8)
        b = Q4Blocks(q, torch.full((16, 2), 0.01).half(), torch.full((16, 2), -0.05).half())
        x = torch.randn(3, 64, generator=gen)
        ref = x.bfloat16().float() @ b.dequantize().T
        return bool(torch.allclose(Q4Linear(b)(x), ref, rtol=2e-2, atol=2e-2))
    except (RuntimeError, AttributeError):
        return False


class Q8AsTwoQ4:
    """A Q8_0 weight (w = d * q, q in [-128, 127], fp16 d per block of 32) as two 4-bit
    products through the same kernel: with u = q + 128 = 16 h + l (h, l in [0, 15]),
    d * q = 16 d * (h - 8) + d * l, so `hi` has scale 16 d and zero 0, `lo` scale d and zero
    8 d (zero - 8 scale = 0: d * l). Reads 9 bits a weight instead of fp32's 32; each half's
    output rounds to bf16 before the two are added in fp32. Row-independent, as Q4Linear."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        u = q.to(torch.int16) + 128  # [N, K] in [0, 255]
        hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
        self.hi = Q4Linear(Q4Blocks(hi, d * 16, d * -128))  # powers of two: exact in fp16
        self.lo = Q4Linear(Q4Blocks(lo, d, torch.zeros_like(d)))
        self.out_features = self.hi.out_features

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.hi(x) + self.lo(x)
