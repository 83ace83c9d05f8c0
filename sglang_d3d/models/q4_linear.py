"""y = x @ W.T + b with W held as a GGUF's Q4_1 blocks, on one of two CPU kernels.

Q4_1 stores each weight as d * q + m: q in [0, 15], one fp16 scale d and minimum m per block
of 32 inputs.

The block products (`cpp`, models/csrc/block_mm.cpp, built on first use): the file's d, m and
q as stored, each weight exactly d * q + m; each input row rounded per block of 32 to 14-bit
integers and the block's sums exact in int32 (AVX-512 VNNI or AVX-VNNI byte dot
products where the CPU has them, AVX2 byte multiply-adds, or plain C++, the same bits). Against fp32
products its error is about 1/16 of bf16 activations' (tests/test_block_mm.py measures both).

torch's int4 weight-only kernel (`aten._weight_int4pack_mm_for_cpu`, the one torchao's int4
CPU layout calls), where the C++ kernels cannot be built: it computes w = (q - 8) * scale +
zero per group of 32, so the same q serve with scale = d and zero = m + 8 d. Its scales and
zeros are bf16 (8-bit significand against fp16's 11): rounding d and m + 8 d moves each weight
by at most (15 * 2^-9 * |d| + 2^-9 * |m + 8 d|), a small fraction of the 4-bit step d itself.
Activations enter it as bf16, the products sum in fp32 and come out as bf16.

Either way each output row depends on its own input row only, bitwise (tested), so a token's
logits do not depend on what else shares its pass; and every pass, of any number of rows, reads
the same bytes.

Why these kernels. SmolLM2-135M's 30 layers' projections, each layer its own weights, 1 thread,
ms for 1 / 4 / 8 / 16 rows, min of 7 runs, the two 4-bit kernels side by side in one process
on a shared machine:
    block products, 14-bit activations (cpp)                  6.6 / 9.4 / 17.8 / 32.0
    int4, bf16 activations                                    9.1 / 14.4 / 25.8 / 45.7
and, measured apart: fp32 (cpu_linear.PackedLinear, the fp32 target's path) 43.5 / 63.8 /
71.2 / 83.0; int8 fbgemm with dynamic activations (int8_linear.py) 15.8 / 18.8 / 23.0 / 29.6;
int4 with fp32 activations 209 at 1 row. fbgemm's int8 scales activations per call, so a row's
result depends on the rows beside it, and it would requantise the file's weights.
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


OCTET = 8  # blocks the block products sum side by side
PAD_BYTES = 128  # bytes past the last row the block products may read (block_mm.h)


def pack_blocks(b: Q4Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4Blocks -> (qs, d, m) as the block products read them (models/csrc/block_mm.cpp):
    each row's blocks in octets of 8, an octet 4 chunks of 32 bytes whose byte 4 j + i is
    byte 4 c + i of block j (a tail of t < 8 blocks: chunks of 4 t bytes); a block's byte i
    holds input i (low nibble) and input 16 + i (high). qs [N * K / 2 + 128] uint8, d and m
    [N * K / 32 + 8] fp16, zero-padded (the kernel reads past the last row and multiplies
    those bytes by zero). Scales in arrays of their own, beside the nibbles, read faster here
    than scales interleaved with them row by row (measured on SmolLM2-135M's layers)."""
    n, k = b.shape
    g = k // GROUP
    q = b.q.view(n, g, GROUP)
    byte = q[..., :16] | (q[..., 16:] << 4)  # [N, G, 16]
    full, tail = divmod(g, OCTET)
    parts = []
    if full:  # [N, full, j, c, i] -> [N, full, c, j, i]
        parts.append(byte[:, : full * OCTET].reshape(n, full, OCTET, 4, 4).permute(0, 1, 3, 2, 4).reshape(n, -1))
    if tail:
        parts.append(byte[:, full * OCTET :].reshape(n, tail, 4, 4).permute(0, 2, 1, 3).reshape(n, -1))
    qs = torch.cat([torch.cat(parts, 1).reshape(-1), torch.zeros(PAD_BYTES, dtype=torch.uint8)])
    pad = torch.zeros(OCTET, dtype=torch.float16)
    return qs, torch.cat([b.d.reshape(-1), pad]), torch.cat([b.m.reshape(-1), pad])


class Q4Linear:
    """One (possibly fused) projection on 4-bit weights: x [..., K] -> [..., N] fp32. Same call
    as cpu_linear.PackedLinear, so the fused layers take either. cpp: the block products (the
    C++ kernels must be loaded), else torch's int4 kernel. `operands`: the weight tensors the
    chosen kernel reads (qs, d and m; or the packed weights and their scales and zeros)."""

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None = None, cpp: bool = False) -> None:
        n, k = blocks.shape
        if k % GROUP:
            raise ValueError(f"4-bit weights need inputs in blocks of {GROUP}, not {k}")
        self.cpp = cpp
        if cpp:
            from sglang_d3d.models import cpu_kernels

            if not cpu_kernels.load():
                raise RuntimeError("the block products need the C++ CPU kernels, which did not build (see the log)")
            self.operands = pack_blocks(blocks)
        else:
            q = blocks.q.to(torch.int32).contiguous()  # [N, K] in [0, 15]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K / 2] uint8
            self.operands = (packed, blocks.scales_zeros())
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = n, k

    @property
    def nbytes(self) -> int:
        """Bytes a pass reads: the 4-bit weights and their scales (and minima or zeros)."""
        return sum(t.numel() * t.element_size() for t in self.operands)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if self.cpp:
            y = torch.ops.d3d_cpu.q4_mm(flat.float(), *self.operands)  # [M, N]
        else:
            packed, scales = self.operands
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), packed, GROUP, scales).float()
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


class Q8Linear:
    """A Q8_0 weight (w = d * q, q int8, fp16 d per block of 32) through the block products'
    fp32 path (models/csrc/block_mm.cpp): x [..., K] -> [..., N] fp32, each weight d * q exact
    in fp32, activations fp32. Row-independent, as Q4Linear."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        self.q, self.d = q.to(torch.int8).contiguous(), d.to(torch.float16).contiguous()
        self.out_features, self.in_features = q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.d3d_cpu.q8_mm(x.reshape(-1, self.in_features).float(), self.q, self.d)
        return y.view(*x.shape[:-1], self.out_features)


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
