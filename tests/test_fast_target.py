"""The target's fast inference path (models/cpu_linear.py, models/fused.py): same numbers as
the HF modules up to float rounding, same greedy tokens, HF modules left untouched."""

from __future__ import annotations

import platform

import pytest
import torch
from conftest import reference_greedy

from sglang_d3d.models.cpu_linear import PackedLinear, fuse, probe
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.target import TargetRunner
from sglang_d3d.testing import tiny_hf_model


def _linears(dtype, bias: bool):
    torch.manual_seed(0)
    return [torch.nn.Linear(32, n, bias=bias).to(dtype) for n in (24, 8, 8)]


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_projection_equals_separate_ones_fp32(rows, bias, threads):
    mods = _linears(torch.float32, bias)
    x = torch.randn(1, rows, 32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = fuse(mods, probe())(x)
    finally:
        torch.set_num_threads(before)
    want = torch.cat([m(x) for m in mods], -1).detach()
    assert got.shape == (1, rows, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp64_falls_back_to_f_linear():
    mods = _linears(torch.float64, True)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    p = fuse(mods, probe())
    assert p.packed is None
    want = torch.cat([m(x) for m in mods], -1).detach()
    torch.testing.assert_close(p(x), want, rtol=1e-12, atol=1e-12)


def test_inputs_needing_gradients_take_the_differentiable_path():
    w = torch.nn.Linear(32, 8)
    x = torch.randn(3, 32, requires_grad=True)
    PackedLinear(w.weight, w.bias, probe())(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="measured on x86 only")
def test_this_machine_has_the_fast_kernels():
    """The CPU target's fast path needs oneDNN (torch's CPU build) and numpy's OpenBLAS; if
    either goes missing the runner still works (F.linear) but silently loses its speed."""
    k = probe()
    assert k.onednn and k.openblas is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_decoder_matches_plain_decoder(arch):
    hf = tiny_hf_model(arch, seed=3)
    target = Decoder.from_hf(hf)
    fast = _prefill_then_verify(TargetRunner(target, 2, 64))
    plain = _prefill_then_verify(TargetRunner(target, 2, 64, fast=False))
    for got, want in zip(fast, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # the HF modules keep their own weights (the drafter copies and wraps them)
    assert isinstance(target.layers[0].self_attn.q_proj, torch.nn.Linear)


def _prefill_then_verify(r: TargetRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (first-token logits [V], a 4-token verify's logits [1, 4, V])."""
    last = r.prefill(0, list(range(5, 25)))
    return last, r.forward_block([0], torch.tensor([[7, 8, 9, 10]]))


def test_prefill_logits_are_the_last_position_of_a_full_pass():
    target = Decoder.from_hf(tiny_hf_model(seed=4))
    r = TargetRunner(target, 1, 64)
    prompt = list(range(3, 30))
    last = r.prefill(0, prompt)
    r.lengths[0] = 0
    full = r.forward_block([0], torch.tensor([prompt]))
    torch.testing.assert_close(last, full[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_greedy_decoding_equals_hf_reference(threads):
    """fp32 on purpose: the fast kernels only run in fp32 (the engine tests use fp64)."""
    hf = tiny_hf_model(seed=5)
    r = TargetRunner(Decoder.from_hf(hf), 1, 96)
    prompt = [5, 17, 33, 2, 60, 11]
    want = reference_greedy(hf, prompt, 24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = [int(r.prefill(0, prompt).argmax())]
        while len(got) < 24:
            logits = r.forward_block([0], torch.tensor([[got[-1]]]))
            r.advance(0, 1)
            got.append(int(logits[0, -1].argmax()))
    finally:
        torch.set_num_threads(before)
    assert got == want


@pytest.mark.parametrize("hidden", [64, 576])
def test_fused_rms_norm_is_bitwise_the_hf_norm(hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from sglang_d3d.models.fused import rms_norm

    norm = LlamaRMSNorm(hidden, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = 3 * torch.randn(2, 7, hidden)
    with torch.no_grad():
        assert torch.equal(rms_norm(norm)(x), norm(x))
    assert rms_norm(norm.double()) is norm  # fp64: HF's upcast-to-fp32 maths, kept as is


def test_rope_tables_give_hf_rotary_embedding_bitwise():
    """The roll form of RoPE (decoder.rope_tables, _rope) is HF's rotate_half form exactly."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from sglang_d3d.models.decoder import _rope, rope_tables

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    angles = torch.rand(2, 5, 8, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    tables = rope_tables(cos, sin)
    assert torch.equal(_rope(q, *tables), ref_q) and torch.equal(_rope(k, *tables), ref_k)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_rope_lookups_are_the_rotarys_own_values_bitwise(arch):
    """Decoder.rope_at reads tables built once (and grown) in place of the rotary's ~12 calls
    a pass; what it reads is what the rotary computes for those positions."""
    from sglang_d3d.models.decoder import rope_tables

    d = Decoder.from_hf(tiny_hf_model(arch))
    h = torch.zeros(1, 1, d.arch.num_heads * d.arch.head_dim)
    for pos in ([[0]], [[5]], [[7, 8, 9, 10]], [[300, 301], [17, 18]], [[2500]], [[1023, 1024]]):
        pos = torch.tensor(pos)
        got, want = d.rope_at(pos, h), rope_tables(*d.rotary(h, pos))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pos
