"""The target on a GGUF's 4-bit weights (target_weights q4): a tiny random llama quantised to
Q4_1 and written as a GGUF here, read back through the path the default target's file takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import make_engine

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.models import q4_linear
from sglang_d3d.models.adapters import delta_modules
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.gguf_q4 import (
    PROJECTIONS,
    permute_for_gguf,
    q4_1_blocks,
    read_q4_layers,
    read_q8_head,
    unpermute_index,
)
from sglang_d3d.models.q4_linear import Q4Blocks, Q4Linear, Q8AsTwoQ4, Q8Linear
from sglang_d3d.models.q4_target import apply_target_weights, resolve_target_weights, use_gguf_q4
from sglang_d3d.models.target import TargetRunner

pytestmark = pytest.mark.skipif(not q4_linear.available(), reason="no int4 CPU kernel in this torch")


def write_q4_gguf(hf, path) -> None:
    """Every projection of `hf` as Q4_1 in llama.cpp's layout (q/k rows permuted); the HF
    weights become the file's dequantised values, so the fp32 runner is the same model."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg, q41 = hf.config, GGMLQuantizationType.Q4_1
    writer = GGUFWriter(str(path), "llama")
    for i, layer in enumerate(hf.model.layers):
        for gguf_name, (part, proj) in PROJECTIONS.items():
            module = getattr(getattr(layer, part), proj)
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(proj)
            w = module.weight.detach().float()
            stored = permute_for_gguf(w, heads) if heads else w
            raw = quants.quantize(stored.numpy(), q41)  # [N, K / 32 * 20] uint8
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", raw, raw_dtype=q41)
            back = torch.from_numpy(quants.dequantize(raw, q41).astype(np.float32))
            with torch.no_grad():
                module.weight.copy_(back[unpermute_index(w.shape[0], heads)] if heads else back)
    emb = hf.model.embed_tokens.weight  # tied: the LM head too
    raw = quants.quantize(emb.detach().float().numpy(), GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        emb.copy_(torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_head_dim_64():
    """A tiny random llama with SmolLM2's head size (64): at 16 torch's attention kernel gave
    the same last bits for 1 query and 5, so rows-alone attention went untested."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper logits: few greedy near-ties
    return hf


@pytest.fixture(scope="module", params=["cpp", "script"])
def q4_models(tmp_path_factory, request):
    """(hf fp32, fp32 Decoder, q4 Decoder, drafter over the q4 one, GGUF path), the q4 model
    on the C++ kernels and on torch's int4 kernel with TorchScript (models/exact_pass.py)."""
    from sglang_d3d.models import cpu_kernels

    if request.param == "cpp" and not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels do not build here (no compiler or ninja)")
    hf = tiny_llama_head_dim_64()
    path = tmp_path_factory.mktemp("q4") / "tiny.Q4_1.gguf"
    write_q4_gguf(hf, path)
    fp32, q4 = Decoder.from_hf(hf), Decoder.from_hf(hf)
    use_gguf_q4(q4, path, q8_head=True, kernels=request.param)
    drafter = D3DDrafter.init_from_target(q4, block_size=4).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # deltas that change the drafts, so verification rejects some
        for _, m in delta_modules(drafter.layers):
            m.delta_b.copy_(torch.randn(m.delta_b.shape, generator=gen) * 0.05)
    return hf, fp32, q4, drafter, path


def test_file_blocks_equal_the_hf_weights(q4_models):
    hf, _, _, _, path = q4_models
    cfg = hf.config
    layers = read_q4_layers(path, cfg.num_attention_heads, cfg.num_key_value_heads)
    for layer, blocks in zip(hf.model.layers, layers):
        for part, proj in PROJECTIONS.values():
            w = getattr(getattr(layer, part), proj).weight
            assert torch.equal(blocks[proj].dequantize(kernel=False), w)


def test_q8_head_is_the_hf_head_and_its_kernel_computes_it(q4_models):
    """fp32 products of the file's weights on the C++ kernels; two 4-bit products (bf16 d and
    activations) on torch's int4 kernel. Row by row either way."""
    hf, _, q4, _, path = q4_models
    q, d = read_q8_head(path)
    w = q.float() * d.float().repeat_interleave(32, 1)
    assert torch.equal(w, hf.lm_head.weight)
    head, x = q4.fused().lm_head, torch.randn(6, w.shape[1])
    if isinstance(head, Q8Linear):
        assert torch.allclose(head(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    else:
        assert isinstance(head, Q8AsTwoQ4)
        rounded = q.float() * d.float().bfloat16().float().repeat_interleave(32, 1)  # bf16 d
        ref = F.linear(x.bfloat16().float(), rounded)
        assert torch.allclose(head(x), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(head(x[2:3]), head(x)[2:3])


def test_block_bytes_decode_as_ggml_lays_them_out():
    """Block: fp16 d, fp16 m, then low nibbles = inputs 0-15, high nibbles = inputs 16-31."""
    q = np.arange(32) % 16
    raw = np.concatenate([np.array([0.5, -1.0], np.float16).view(np.uint8),
                          (q[:16] | (q[16:] << 4)).astype(np.uint8)])[None]  # [1, 20]
    b = q4_1_blocks(raw)
    assert torch.equal(b.q[0].long(), torch.from_numpy(q))
    assert torch.equal(b.dequantize(kernel=False)[0], torch.from_numpy(q * 0.5 - 1.0).float())


def test_int4_kernel_computes_the_rounded_weights_row_by_row():
    """torch's int4 kernel's weight is (q - 8) * bf16(d) + bf16(m + 8 d); bf16 inputs, fp32 sums; and
    each output row is bitwise what that row alone gives."""
    gen = torch.Generator().manual_seed(1)
    n, k = 96, 128
    b = Q4Blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                 (torch.rand(n, k // 32, generator=gen) * 0.05).half(),
                 (torch.randn(n, k // 32, generator=gen) * 0.1).half())
    lin, x = Q4Linear(b), torch.randn(19, k, generator=gen)
    y = lin(x)
    ref = F.linear(x.bfloat16().float(), b.dequantize())
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2)
    assert (b.dequantize() - b.dequantize(kernel=False)).abs().max() <= 2 ** -8 * b.d.float().abs().max() * 16
    for lo, hi in ((0, 1), (4, 5), (0, 7), (3, 19)):
        assert torch.equal(lin(x[lo:hi]), y[lo:hi])


@pytest.mark.parametrize("threads", [1, 2])
def test_plain_steps_equal_a_verify_pass_bitwise(q4_models, threads):
    """The same tokens' logits, one step at a time or in one chain verify."""
    _, _, q4, _, _ = q4_models
    torch.set_num_threads(threads)
    try:
        for length in (7, 40, 90):
            r = TargetRunner(q4, 2, 128)
            prompt, cont = [(i * 7) % 90 + 3 for i in range(length)], [31, 37, 41, 43, 47]
            r.prefill(0, prompt)
            r.prefill(1, prompt)
            steps = []
            for t in cont:
                steps.append(r.forward_block([0], torch.tensor([[t]]))[0, 0])
                r.advance(0, 1)
            block = r.forward_block([1], torch.tensor([cont]))[0]
            assert torch.equal(torch.stack(steps), block), length
    finally:
        torch.set_num_threads(1)


PROMPTS = [[5, 9, 13, 17, 21], [30, 31, 32, 33, 30, 31, 32], [7, 70, 7, 71, 7, 72, 7]]


@pytest.mark.parametrize("widths", [{}, {"lookup_tokens": 8, "copy_guesses": 8},
                                    {"draft_input_bits": 14}])
@pytest.mark.parametrize("batch", [1, 3])
def test_modes_greedy_identical_on_the_q4_runner(q4_models, batch, widths):
    """With the q4 runner's own short copies alone, and with long copies and guesses; the
    drafter's passes on 8-bit inputs (the default) and on the target's 14 bits."""
    from sglang_d3d.engine.offline import generate

    hf, _, q4, drafter, _ = q4_models
    params = SamplingParams(max_new_tokens=24)
    outs = {}
    fused = drafter.on_exact_loop()  # on the C++ loop only (the next test)
    for mode in (Mode.AR, Mode.SYNC, Mode.ASYNC) + ((Mode.FUSED,) if fused else ()):
        eng = make_engine((hf, q4, drafter), mode, batch=batch, **widths)
        outs[mode] = [o.token_ids for o in generate(eng, PROMPTS, params)]
    assert outs[Mode.SYNC] == outs[Mode.AR]
    assert outs[Mode.ASYNC] == outs[Mode.AR]
    if fused:
        assert outs[Mode.FUSED] == outs[Mode.AR]


def test_fused_mode_needs_the_cpp_layer_loop_on_4bit_weights(q4_models):
    """Off the C++ loop the drafter's pass would not compute verify rows as plain steps do."""
    hf, _, q4, drafter, _ = q4_models
    if drafter.on_exact_loop():
        pytest.skip("the C++ loop serves this target: fused mode runs (the test above)")
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels did not build"):
        make_engine((hf, q4, drafter), Mode.FUSED, batch=1)


def test_copies_are_short_and_alone_where_verify_rows_run_apart(q4_models):
    """Each token of a q4 verify pass is its own attention pass, so copies default to 4
    tokens without guesses there, and to 8 with 8 guesses on fp32; a setting given stays."""
    from sglang_d3d.engine.copy_arms import ALONE, SHORT

    hf, fp32, q4, drafter, _ = q4_models
    assert q4.rows_apart and not fp32.rows_apart
    eng = make_engine((hf, q4, drafter), Mode.SYNC, batch=1)
    assert (eng.cfg.lookup_tokens, eng.cfg.copy_guesses) == (4, 0)
    assert eng.copy_arms.ways(1) == (ALONE, SHORT)
    eng = make_engine((hf, q4, drafter), Mode.SYNC, batch=1, lookup_tokens=6)
    assert (eng.cfg.lookup_tokens, eng.cfg.copy_guesses) == (6, 0)
    eng = make_engine((hf, fp32, None), Mode.AR, batch=1)
    assert (eng.cfg.lookup_tokens, eng.cfg.copy_guesses) == (8, 8)


def test_fp32_runner_unchanged_and_equal_to_hf_generate(q4_models):
    from sglang_d3d.engine.offline import generate

    hf, fp32, _, _, _ = q4_models
    assert apply_target_weights(fp32, "auto", "some/folder", "cpu") == "fp32"
    assert not fp32.fused().exact_rows
    prompt = PROMPTS[0]
    eng = make_engine((hf, fp32, None), Mode.AR, batch=1)
    ours = generate(eng, [prompt], SamplingParams(max_new_tokens=12))[0].token_ids
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert ours == ref.tolist()


def test_q4_needs_a_gguf_a_cpu_and_fp32(tmp_path):
    with pytest.raises(ValueError, match="q4"):
        resolve_target_weights("q4", None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="q4"):
        resolve_target_weights("q4", tmp_path / "x.gguf", "cpu", torch.bfloat16)
    assert resolve_target_weights("auto", tmp_path / "x.gguf", "cuda", torch.float32) == "fp32"
    assert resolve_target_weights("auto", tmp_path / "x.gguf", "cpu", torch.float32) == "q4"
    with pytest.raises(ValueError, match="target_weights"):
        EngineConfig(target_weights="int4")
