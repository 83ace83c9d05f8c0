"""The 4-bit target's scripted decode and verify pass (models/exact_pass.py): every query alone,
so a token's logits are bitwise the same in a plain step, a chain, a tree and a batch."""

from __future__ import annotations

import pytest
import torch
from test_q4_target import q4_models  # noqa: F401 - the module's fixture, shared

from sglang_d3d.models import cpu_kernels, q4_linear
from sglang_d3d.models.decoder import rope_tables
from sglang_d3d.models.exact_pass import _layers, key_plan, scripted_layers
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


@torch.inference_mode()
def _layer_outputs(q4, fns) -> list[torch.Tensor]:
    """Each implementation's hidden states for the same two tokens after the same prompt."""
    exact, outs = q4.fused().exact, []
    for fn in fns:
        r = _runner(q4)
        ids, pos = torch.tensor([[31, 37]]), torch.tensor([[23, 24]])
        h = q4.embed_tokens(ids)
        cos, sin = rope_tables(*q4.rotary(h, pos))
        exact._fn, saved = fn, exact._fn
        try:
            mask = torch.arange(25).view(1, 1, 25) <= pos.unsqueeze(-1)
            outs.append(exact(h, cos, sin, r.cache, [0], pos, key_plan(mask)))
        finally:
            exact._fn = saved
    return outs


def test_scripted_layers_equal_the_python_function_bitwise(q4_models):  # noqa: F811
    """The eager function is the fallback where scripting fails: it must compute the same."""
    scripted = scripted_layers()
    assert scripted is not _layers  # this torch scripts it
    a, b = _layer_outputs(q4_models[2], (scripted, _layers))
    assert torch.equal(a, b)


def test_cpp_layers_compute_the_scripted_model(q4_models):  # noqa: F811
    """Two implementations of one model, each exact with itself (tested above): their sums
    run in different orders, so they agree up to where bf16 roundings of the projections'
    inputs fall (on this tiny model, often to the bit)."""
    op = cpu_kernels.exact_layers()
    if op is None:
        pytest.skip("the C++ CPU kernels do not build here")
    a, b = _layer_outputs(q4_models[2], (op, scripted_layers()))
    assert torch.allclose(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_unsupported_layers_are_refused(q4_models):  # noqa: F811
    from dataclasses import replace

    from sglang_d3d.models.exact_pass import ExactWeights

    _, _, q4, _, _ = q4_models
    layers = q4.fused().layers
    gelu = replace(layers[0], act=torch.nn.GELU())
    with pytest.raises(ValueError, match="SiLU"):
        ExactWeights.from_layers((gelu, *layers[1:]), (2, 1, 64))


@torch.inference_mode()
def test_biases_are_added_by_both_implementations(q4_models):  # noqa: F811
    """Qwen2-style q/k/v biases: the C++ loop adds them where the TorchScript one does."""
    from dataclasses import replace

    op = cpu_kernels.exact_layers()
    if op is None:
        pytest.skip("the C++ CPU kernels do not build here")
    q4 = q4_models[2]
    exact = q4.fused().exact
    width = exact.weights.packed[0].shape[0]  # qkv outputs
    gen = torch.Generator().manual_seed(5)
    biases = [torch.randn(width, generator=gen) if i % 4 == 0 else b
              for i, b in enumerate(exact.weights.biases)]
    outs = []
    for weights in (exact.weights, replace(exact.weights, biases=biases)):
        saved = exact.weights
        exact.weights = weights
        try:
            outs.append(_layer_outputs(q4, (op, scripted_layers())))
        finally:
            exact.weights = saved
    (plain_cpp, _), (cpp, script) = outs
    assert torch.allclose(cpp, script, rtol=0.05, atol=0.05 * float(script.abs().max()))
    assert not torch.allclose(cpp, plain_cpp, atol=1e-3)  # the biases changed something


def test_cpp_kernels_build_wherever_a_compiler_is_present():
    """A broken C++ source must fail here, not fall back unseen to the slower path."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    assert cpu_kernels.exact_layers() is not None
