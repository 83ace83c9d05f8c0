"""The block products on a GGUF's own Q4_1 and Q8_0 weights (models/csrc/block_mm.cpp): the
file's weights exactly, each output row bitwise the same whatever shares its call, and the
vector path equal to the plain C++ one."""

from __future__ import annotations

import pytest
import torch

from sglang_d3d.models import cpu_kernels
from sglang_d3d.models.q4_linear import Q4Blocks, Q4Linear, Q8Linear, pack_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels do not build here")


def _blocks(n: int, k: int, seed: int = 0) -> Q4Blocks:
    gen = torch.Generator().manual_seed(seed)
    return Q4Blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                    (torch.rand(n, k // 32, generator=gen) * 0.05).half(),
                    (-torch.rand(n, k // 32, generator=gen) * 0.4).half())


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen)  # uneven magnitudes


# inputs of 1, 2, 8 (a full octet), 11, 12, 13 and 48 blocks: every kind of last octet (1 or 2
# blocks, 3 or 4, more) after none, one or several full ones
SHAPES = [(40, 32), (33, 64), (24, 256), (21, 352), (18, 384), (40, 416), (17, 1536)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_q4_products_are_the_file_weights_times_14_bit_inputs(n, k):
    """Against float64 products of the file's own d * q + m, the error stays well inside what
    rounding the inputs to bf16 alone costs."""
    b, x = _blocks(n, k), _x(19, k)
    w = b.dequantize(kernel=False).double()  # [N, K], the file's weights
    exact = x.double() @ w.T
    err = (Q4Linear(b, cpp=True)(x).double() - exact).abs().max()
    bf16_err = (x.bfloat16().double() @ w.T - exact).abs().max()
    assert err < bf16_err / 4


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES)
def test_each_q4_row_is_bitwise_the_same_alone_or_in_a_batch(n, k, threads):
    lin, x = Q4Linear(_blocks(n, k), cpp=True), _x(19, k)
    torch.set_num_threads(threads)
    try:
        y = lin(x)
        for lo, hi in ((0, 1), (4, 5), (0, 7), (3, 19), (18, 19)):
            assert torch.equal(lin(x[lo:hi]), y[lo:hi])
    finally:
        torch.set_num_threads(1)
    assert torch.equal(lin(x), y)  # and with one thread


@pytest.mark.parametrize("n,k", SHAPES)
def test_vector_path_equals_the_plain_cpp_one_bitwise(n, k):
    """Integer block sums are exact either way and the fp32 steps run in one order: the
    vector path this CPU takes (torch.ops.d3d_cpu.q4_path()) and the portable loop give the
    same bits."""
    lin, x = Q4Linear(_blocks(n, k), cpp=True), _x(9, k)
    fast = torch.ops.d3d_cpu.q4_mm(x, *lin.operands)
    plain = torch.ops.d3d_cpu.q4_mm(x, *lin.operands, portable=True)
    assert torch.equal(fast, plain)


def test_inputs_halfway_between_integers_round_to_even_on_both_paths():
    """With a block's largest magnitude 16256 the scale is 1, so k + 0.5 meets the rounding
    exactly: the vector conversion and the plain loop must both give the even neighbour."""
    lin = Q4Linear(_blocks(8, 64), cpp=True)
    x = torch.arange(64, dtype=torch.float32).sub(32).add(0.5).unsqueeze(0)  # -31.5 .. 31.5
    x[0, 0], x[0, 32] = 16256.0, -16256.0
    fast = torch.ops.d3d_cpu.q4_mm(x, *lin.operands)
    plain = torch.ops.d3d_cpu.q4_mm(x, *lin.operands, portable=True)
    assert torch.equal(fast, plain)
    w = _blocks(8, 64).dequantize(kernel=False).double()  # [8, 64], the file's weights
    even = torch.round(x.double())  # torch rounds halves to even; away from zero is off by ~w
    assert torch.allclose(fast.double(), even @ w.T, rtol=1e-6, atol=1e-3)


def test_largest_nibbles_and_inputs_stay_exact_in_the_vector_sums():
    """Every nibble 15 against every input byte at its extreme (h = +-127, l = 127): the
    largest sums any path forms, in int16 on AVX2, must not saturate or wrap."""
    q = torch.full((8, 64), 15, dtype=torch.uint8)
    b = Q4Blocks(q, torch.full((8, 2), 0.01).half(), torch.full((8, 2), -0.1).half())
    lin = Q4Linear(b, cpp=True)
    x = torch.tensor([[16256.0] + [16255.0] * 31 + [-16256.0] + [-16129.0] * 31,  # scale 1: xq = x
                      [-16129.0] * 31 + [16256.0] + [16255.0] * 32])
    fast = torch.ops.d3d_cpu.q4_mm(x, *lin.operands)
    assert torch.equal(fast, torch.ops.d3d_cpu.q4_mm(x, *lin.operands, portable=True))
    w = b.dequantize(kernel=False).double()  # [8, 64]
    scale = x.double().abs() @ w.abs().T  # the terms' size: the sums cancel, fp32 rounds on it
    assert ((fast.double() - x.double() @ w.T).abs() < 1e-6 * scale).all()


def test_zero_blocks_and_rows_give_exact_zeros():
    b = _blocks(16, 64)
    lin = Q4Linear(Q4Blocks(b.q, b.d, torch.zeros_like(b.m)), cpp=True)
    x = _x(3, 64)
    x[0] = 0.0
    x[1, :32] = 0.0  # one block without magnitude: no division by zero
    y = lin(x)
    assert torch.equal(y[0], torch.zeros(16))
    assert torch.isfinite(y).all()


def test_packing_keeps_the_bytes_and_pads_the_end():
    b = _blocks(3, 320)  # 10 blocks: one octet and a tail of 2
    qs, d, m = pack_blocks(b)
    assert qs.numel() == 3 * 160 + 128 and not qs[-128:].any()
    assert d.numel() == 3 * 10 + 8 and not d[-8:].any() and torch.equal(d[:30], b.d.reshape(-1))
    assert torch.equal(m[:30], b.m.reshape(-1))
    # row 1, block 9 (the tail's second), byte 5 (chunk 1, byte 1): inputs 5 and 21
    byte = qs[160 + 8 * 16 + 1 * 8 + 4 * 1 + 1]
    assert int(byte) == int(b.q[1, 9 * 32 + 5]) | (int(b.q[1, 9 * 32 + 21]) << 4)


def test_mismatched_weights_are_refused_clearly():
    lin = Q4Linear(_blocks(8, 64), cpp=True)
    with pytest.raises(RuntimeError, match="q4_mm"):
        torch.ops.d3d_cpu.q4_mm(torch.randn(2, 96), *lin.operands)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        torch.ops.d3d_cpu.q4_mm(torch.randn(2, 40), *lin.operands)


def test_q8_products_are_the_file_weights_in_fp32_row_by_row():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (50, 96), generator=gen, dtype=torch.int8)
    d = (torch.rand(50, 3, generator=gen) * 0.01).half()
    head, x = Q8Linear(q, d), _x(11, 96)
    w = q.double() * d.double().repeat_interleave(32, 1)
    y = head(x)
    assert torch.allclose(y.double(), x.double() @ w.T, rtol=1e-5, atol=1e-6)
    for lo, hi in ((0, 1), (3, 4), (2, 11)):
        assert torch.equal(head(x[lo:hi]), y[lo:hi])


@pytest.mark.parametrize("rows", [1, 2, 3, 7])
def test_q8_vector_path_equals_the_generic_loop_bitwise(rows):
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (37, 160), generator=gen, dtype=torch.int8)
    d = (torch.rand(37, 5, generator=gen) * 0.01).half()
    x = _x(rows, 160)
    assert torch.equal(torch.ops.d3d_cpu.q8_mm(x, q, d), torch.ops.d3d_cpu.q8_mm(x, q, d, True))


def test_kernels_run_on_torchs_threads():
    """Built with OpenMP, the kernels split their rows over torch's intra-op threads."""
    torch.set_num_threads(2)
    try:
        assert torch.ops.d3d_cpu.kernel_threads() == min(2, torch.get_num_threads())
    finally:
        torch.set_num_threads(1)


def _coarse_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the coarse products read it, in float64: each block of 32 rounded to 14-bit
    integers xq (to even), then on to the nearest multiple of 128, halves up (block_mm.cpp)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)  # [M, G, 1]
    inv = torch.where(amax > 0, 16256.0 / amax, torch.zeros_like(amax))
    xq = torch.round((xb * inv).clamp(-16256, 16256)).to(torch.int64)  # fp32 product, as the kernel
    h, low = torch.div(xq, 128, rounding_mode="floor"), xq % 128
    coarse = (h + (low >= 64).to(torch.int64)) * 128  # [M, G, 32]
    return (coarse.double() * (amax.double() / 16256)).view(m, k)


@pytest.mark.parametrize("n,k", SHAPES)
def test_coarse_q4_products_are_the_file_weights_times_8_bit_inputs(n, k):
    """coarse=True (a drafter's passes): the products of the inputs rounded to 8 bits a block.
    Against float64 products of those inputs the error is fp32 summation's alone, far below
    what the coarser rounding itself moves the outputs."""
    b, x = _blocks(n, k), _x(19, k)
    w = b.dequantize(kernel=False).double()  # [N, K]
    y = torch.ops.d3d_cpu.q4_mm(x, *Q4Linear(b, cpp=True).operands, coarse=True).double()
    rounded = _coarse_reference(x) @ w.T
    moved = (rounded - x.double() @ w.T).abs().max()
    assert (y - rounded).abs().max() < moved / 50


@pytest.mark.parametrize("n,k", SHAPES)
def test_coarse_vector_path_equals_the_plain_one_and_each_row_stands_alone(n, k):
    """The AVX-512 pairs skip the zero low bytes, the other paths multiply them: the same bits,
    and a row's output does not depend on which rows share its call."""
    lin, x = Q4Linear(_blocks(n, k), cpp=True), _x(9, k)
    fast = torch.ops.d3d_cpu.q4_mm(x, *lin.operands, coarse=True)
    assert torch.equal(fast, torch.ops.d3d_cpu.q4_mm(x, *lin.operands, portable=True, coarse=True))
    for lo, hi in ((0, 1), (2, 7), (8, 9)):
        assert torch.equal(torch.ops.d3d_cpu.q4_mm(x[lo:hi], *lin.operands, coarse=True), fast[lo:hi])
    assert not torch.equal(fast, torch.ops.d3d_cpu.q4_mm(x, *lin.operands))  # it is coarser
