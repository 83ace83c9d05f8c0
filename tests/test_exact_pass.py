"""The 4-bit target's one-call decode and verify pass (models/exact_pass.py), in C++ and in
TorchScript: every query alone, so a token's logits are bitwise the same in a plain step, a
chain, a tree and a batch."""

from __future__ import annotations

import pytest
import torch
from test_q4_target import q4_models, tiny_llama_head_dim_64, write_q4_gguf  # noqa: F401 - shared

from sglang_d3d.models import cpu_kernels, exact_pass, q4_linear
from sglang_d3d.models.decoder import Decoder, rope_tables
from sglang_d3d.models.exact_pass import _layers, key_plan, scripted_layers
from sglang_d3d.models.q4_target import use_gguf_q4
from sglang_d3d.models.target import TargetRunner

pytestmark = pytest.mark.skipif(not q4_linear.available(), reason="no int4 CPU kernel in this torch")

PROMPT = [(i * 7) % 90 + 3 for i in range(23)]


def _runner(q4, slots: int = 1) -> TargetRunner:
    r = TargetRunner(q4, slots, 64)
    for s in range(slots):
        r.prefill(s, PROMPT)
    return r


def _plain(q4, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: one plain step per token."""
    r, out = _runner(q4), []
    for t in tokens:
        out.append(r.forward_block([0], torch.tensor([[t]]))[0, 0])
        r.advance(0, 1)
    return torch.stack(out)


def test_key_plan_counts_prefixes_and_lists_tree_paths():
    mask = torch.zeros(1, 3, 6, dtype=torch.bool)
    mask[0, 0, :4] = True  # a prefix: a count
    mask[0, 1, :5] = True
    mask[0, 2, [0, 1, 2, 3, 5]] = True  # a tree node past a sibling: its indices
    plan = key_plan(mask)
    assert plan.counts == [4, 5, -1]
    assert plan.paths[2].tolist() == [0, 1, 2, 3, 5]
    assert plan.paths[0].numel() == 0


def test_tree_nodes_equal_plain_steps_along_their_path(q4_models):  # noqa: F811
    """Root 31 with children 37 and 41, and 43 under 41: the path 31, 41, 43 of the tree pass
    gives plain decoding's logits bitwise."""
    _, _, q4, _, _ = q4_models
    tokens = torch.tensor([[31, 37, 41, 43]])
    depths = torch.tensor([[0, 1, 1, 2]])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree = _runner(q4).forward_block([0], tokens, trees=(depths, anc.unsqueeze(0)))[0]
    assert torch.equal(tree[[0, 2, 3]], _plain(q4, [31, 41, 43]))


def test_rows_of_a_batch_equal_each_row_alone(q4_models):  # noqa: F811
    _, _, q4, _, _ = q4_models
    r = _runner(q4, slots=2)
    r.advance(1, -3)  # rows of different lengths share the pass
    both = r.forward_block([0, 1], torch.tensor([[31, 37, 41], [43, 47, 53]]))
    alone = _runner(q4, slots=2)
    alone.advance(1, -3)
    assert torch.equal(both[0], alone.forward_block([0], torch.tensor([[31, 37, 41]]))[0])
    assert torch.equal(both[1], alone.forward_block([1], torch.tensor([[43, 47, 53]]))[0])


def test_logits_are_bitwise_the_same_on_one_thread_or_two(q4_models):  # noqa: F811
    """Projections split weight rows and attention splits heads over torch's threads; no sum
    may depend on the split."""
    _, _, q4, _, _ = q4_models
    tokens = torch.tensor([[31, 37, 41, 43]])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _runner(q4).forward_block([0], tokens)
        torch.set_num_threads(2)
        two = _runner(q4).forward_block([0], tokens)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(fp32 Decoder, q4 Decoder on the C++ kernels, q4 Decoder on torch's int4 kernel and
    TorchScript), one tiny model's GGUF."""
    if not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels do not build here")
    hf = tiny_llama_head_dim_64()
    path = tmp_path_factory.mktemp("q4both") / "tiny.Q4_1.gguf"
    write_q4_gguf(hf, path)
    models = [Decoder.from_hf(hf) for _ in range(3)]
    use_gguf_q4(models[1], path, q8_head=True, kernels="cpp")
    use_gguf_q4(models[2], path, q8_head=True, kernels="script")
    return models


@torch.inference_mode()
def _layer_outputs(q4, fns=(None,)) -> list[torch.Tensor]:
    """The hidden states for the same two tokens after the same prompt, through the model's
    own layer loop (None) or each of `fns` on its weights."""
    exact, outs = q4.fused().exact, []
    for fn in fns:
        r = _runner(q4)
        ids, pos = torch.tensor([[31, 37]]), torch.tensor([[23, 24]])
        h = q4.embed_tokens(ids)
        cos, sin = rope_tables(*q4.rotary(h, pos))
        exact._fn, saved = fn or exact._fn, exact._fn
        try:
            mask = torch.arange(25).view(1, 1, 25) <= pos.unsqueeze(-1)
            outs.append(exact(h, cos, sin, r.cache, [0], pos, key_plan(mask)))
        finally:
            exact._fn = saved
    return outs


def test_scripted_layers_equal_the_python_function_bitwise(both):
    """The eager function is the fallback where scripting fails: it must compute the same."""
    scripted = scripted_layers()
    assert scripted is not _layers  # this torch scripts it
    a, b = _layer_outputs(both[2], (scripted, _layers))
    assert torch.equal(a, b)


def test_cpp_and_scripted_loops_compute_one_model(both):
    """Two kernels on the same file's weights, each exact with itself (tested above), agree
    within the bf16 roundings of the scripted one."""
    _, cpp, script = both
    a, b = _layer_outputs(cpp)[0], _layer_outputs(script)[0]
    assert torch.allclose(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_cpp_kernels_land_closer_to_fp32_than_bf16_activations(both):
    """The same weights (the file's), three arithmetics: the block products' logits sit
    nearer fp32's than those of torch's int4 kernel (bf16 activations and scales)."""
    logits = []
    for model in both:
        r = _runner(model)
        logits.append(r.forward_block([0], torch.tensor([[31, 37, 41]]))[0])
    fp32, cpp, script = logits
    assert (cpp - fp32).abs().max() < 0.5 * (script - fp32).abs().max()


def _tiny_llama(heads: int, kv_heads: int, head_dim: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(heads * head_dim)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper logits: few greedy near-ties
    return hf


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (8, 2, 128), (3, 1, 32)])
def test_query_heads_that_share_a_key_value_head_attend_together_exactly(tmp_path, heads, kv_heads, head_dim):
    """The C++ loop takes the query heads of one key-value head together, in runs whose length
    depends on the head size and the threads (exact_layers.cpp, group_attention): a verify
    block's rows are plain steps bitwise on 1 and 2 threads, and the logits are the fp32
    model's within the 14-bit inputs' rounding."""
    if not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels do not build here")
    hf = _tiny_llama(heads, kv_heads, head_dim)
    write_q4_gguf(hf, tmp_path / "tiny.Q4_1.gguf")
    fp32, q4 = Decoder.from_hf(hf), Decoder.from_hf(hf)
    use_gguf_q4(q4, tmp_path / "tiny.Q4_1.gguf", q8_head=True, kernels="cpp")
    tokens = [31, 37, 41, 43, 47]
    before, blocks = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            blocks.append(_runner(q4).forward_block([0], torch.tensor([tokens]))[0])
            assert torch.equal(blocks[-1], _plain(q4, tokens))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(blocks[0], blocks[1])
    ref = _runner(fp32).forward_block([0], torch.tensor([tokens]))[0]
    assert torch.equal(blocks[0].argmax(-1), ref.argmax(-1))
    assert torch.allclose(blocks[0], ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_rows_of_a_slot_read_a_long_shared_prefix_together_exactly(tmp_path):
    """Past 1536 shared cache positions the rows of one slot take them together, block by block
    (attention.h): a chain's and a tree's rows after a 1600-token prompt are plain steps
    bitwise, beside a second slot's row, on 1 and 2 threads."""
    if not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels do not build here")
    hf = _tiny_llama(6, 2, 64)
    write_q4_gguf(hf, tmp_path / "tiny.Q4_1.gguf")
    q4 = Decoder.from_hf(hf)
    use_gguf_q4(q4, tmp_path / "tiny.Q4_1.gguf", q8_head=True, kernels="cpp")
    prompt = [(i * 13) % 90 + 3 for i in range(1600)]

    def runner() -> TargetRunner:
        r = TargetRunner(q4, 2, 1700)
        r.prefill(0, prompt)
        r.prefill(1, prompt[:1590])
        return r

    def plain(slot: int, tokens: list[int]) -> torch.Tensor:
        r, out = runner(), []
        for t in tokens:
            out.append(r.forward_block([slot], torch.tensor([[t]]))[0, 0])
            r.advance(slot, 1)
        return torch.stack(out)

    chain, other = [31, 37, 41, 43, 47], [53, 59, 61, 67, 71]
    depths = torch.tensor([[0, 1, 1, 2]])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            both = runner().forward_block([0, 1], torch.tensor([chain, other]))
            assert torch.equal(both[0], plain(0, chain))
            assert torch.equal(both[1], plain(1, other))
            tree = runner().forward_block([0], torch.tensor([[31, 37, 41, 43]]), trees=(depths, anc.unsqueeze(0)))[0]
            assert torch.equal(tree[[0, 2, 3]], plain(0, [31, 41, 43]))
    finally:
        torch.set_num_threads(before)


def test_unsupported_layers_are_refused(q4_models):  # noqa: F811
    from dataclasses import replace

    from sglang_d3d.models.exact_pass import ExactWeights

    _, _, q4, _, _ = q4_models
    layers = q4.fused().layers
    gelu = replace(layers[0], act=torch.nn.GELU())
    with pytest.raises(ValueError, match="SiLU"):
        ExactWeights.from_layers((gelu, *layers[1:]), (2, 1, 64), q4.fused().norm)


@torch.inference_mode()
def test_biases_are_added_by_both_implementations(both):
    """Qwen2-style q/k/v biases: the C++ loop adds them where the TorchScript one does."""
    from dataclasses import replace

    _, cpp_model, script_model = both
    width = cpp_model.fused().layers[0].qkv.out_features
    gen = torch.Generator().manual_seed(5)
    biases = [torch.randn(width, generator=gen) if i % 4 == 0 else None
              for i in range(len(cpp_model.fused().exact.weights.biases))]
    outs = []
    for q4 in (cpp_model, script_model):
        exact = q4.fused().exact
        saved = exact.weights
        try:
            for weights in (saved, replace(saved, biases=biases)):
                exact.weights = weights
                outs.append(_layer_outputs(q4)[0])
        finally:
            exact.weights = saved
    plain_cpp, cpp, _, script = outs
    assert torch.allclose(cpp, script, rtol=0.05, atol=0.05 * float(script.abs().max()))
    assert not torch.allclose(cpp, plain_cpp, atol=1e-3)  # the biases changed something


def test_cpp_kernels_build_wherever_a_compiler_is_present():
    """A broken C++ source must fail here, not fall back unseen to the slower path."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    assert cpu_kernels.exact_layers() is not None


def test_auto_leaves_the_plain_cpp_loop_for_torchs_kernel(monkeypatch):
    """Without vector block products (no AVX2) auto takes torch's int4 kernel; cpp still
    asks for the C++ kernels outright."""
    if not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels do not build here")
    assert exact_pass.use_cpp("auto") == cpu_kernels.vectorised()
    monkeypatch.setattr(cpu_kernels, "vectorised", lambda: False)
    assert exact_pass.use_cpp("auto") is False
    assert exact_pass.use_cpp("cpp") is True
    assert exact_pass.use_cpp("script") is False


@torch.inference_mode()
def test_cpp_loop_refuses_weights_not_in_the_block_layout(both):
    """The C++ loop reads its projections unchecked inside: a weight cut short is refused
    with the layout's error before any is read, and the cache is left as it was."""
    from dataclasses import replace

    _, cpp_model, _ = both
    exact = cpp_model.fused().exact
    saved = exact.weights
    qs = list(saved.operands[0])
    qs[-1] = qs[-1][:-64]  # the last layer's down: checked before layer 0 writes
    exact.weights = replace(saved, operands=(qs, *saved.operands[1:]))
    r = _runner(cpp_model)
    before = r.cache.k.clone()
    try:
        with pytest.raises(RuntimeError, match="q4_mm: qs"):
            r.forward_block([0], torch.tensor([[31]]))
    finally:
        exact.weights = saved
    assert torch.equal(r.cache.k, before)
