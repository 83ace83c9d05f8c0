"""Every supported target family is served exactly, and every other one is refused by name.

Supported (models/architectures.py): Llama (also with Llama 3's rope scaling and a vocabulary
above uint16), Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms). For each, on
a tiny random target in float64: the engine's greedy output with a drafter equals plain `ar`
decoding and transformers' own greedy `generate` on the same weights, and the drafter built
from the target computes the target's layers exactly on clean tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.architectures import (
    SUPPORTED,
    UnsupportedArchitectureError,
    check_context,
    sliding_window,
    supported_list,
)
from sglang_d3d.models.decoder import Batch, Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_hf_model
from sglang_d3d.testing import LARGE_VOCAB, TINY_ARCHS, TINY_VOCAB, TINY_WINDOW, make_tiny_pair

VOCAB = {"llama3": LARGE_VOCAB}  # the others: TINY_VOCAB
NEW_TOKENS = 16


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 2)]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(arch, hf_model, target Decoder, drafter) in float64, built once per family."""
    arch = request.param
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp(arch), arch=arch, seed=2,
                                             vocab=VOCAB.get(arch, TINY_VOCAB))
    hf = load_hf_model(Path(target_dir)).double()
    target = Decoder.from_hf(hf)
    return arch, hf, target, D3DDrafter.from_pretrained(drafter_dir, target)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate with its own cache, never stopping early."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_greedy_with_a_drafter_equals_ar_and_transformers(family):
    arch, hf, target, drafter = family
    models = (hf, target, drafter)
    prompts = _prompts(target.arch.vocab_size)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    ar = generate(make_engine(models, Mode.AR), prompts, params)
    sync = generate(make_engine(models, Mode.SYNC, block=4), prompts, params)
    for prompt, a, s in zip(prompts, ar, sync, strict=True):
        assert a.error is None and s.error is None
        assert s.token_ids == a.token_ids == hf_greedy(hf, prompt, NEW_TOKENS), arch
    assert max(o.stats.mean_accepted_length for o in sync) > 1  # drafts were accepted


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_a_full_depth_drafter_is_the_target_on_clean_tokens(family):
    """A fresh drafter (zero deltas) over every layer: its clean-token logits are the
    target's, so biases, q/k norms and rope scaling reach the drafter's path too."""
    arch, hf, target, _ = family
    drafter = D3DDrafter.init_from_target(target, None, block_size=4, rank=4, alpha=4.0)
    assert drafter.cfg.base_model_type == hf.config.model_type and drafter.is_full_depth
    ids = torch.tensor([_prompts(target.arch.vocab_size)[1]])  # [1, T]
    t = ids.shape[1]
    pos = torch.arange(t).unsqueeze(0)
    causal = torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0)  # [1, T, T]
    with torch.no_grad():
        got = drafter.logits(drafter.hidden(ids, pos, causal))
        want = hf(ids).logits
        ours = target(ids, Batch(pos, causal))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)


def test_the_tiny_families_carry_what_makes_each_one_different(tmp_path):
    from sglang_d3d.testing import tiny_hf_model

    qwen2 = tiny_hf_model("qwen2")
    assert qwen2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert tiny_hf_model("qwen3").model.layers[0].self_attn.q_norm is not None
    llama3 = tiny_hf_model("llama3", vocab=LARGE_VOCAB)
    assert llama3.config.rope_parameters["rope_type"] == "llama3"
    assert llama3.lm_head.weight.data_ptr() != llama3.model.embed_tokens.weight.data_ptr()
    assert sliding_window(tiny_hf_model("mistral").config) == TINY_WINDOW
    assert sliding_window(qwen2.config) is None


# ---- sliding window -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_sliding_window_target_is_exact_up_to_its_window(family):
    """A request filling the whole window: transformers attends within the window, we attend
    over everything; inside the window the two are the same."""
    _, hf, target, drafter = family
    prompt = _prompts(TINY_VOCAB)[0] * (TINY_WINDOW // 5)
    prompt = prompt[: TINY_WINDOW - NEW_TOKENS]
    out = generate(make_engine((hf, target, drafter), Mode.SYNC, context=TINY_WINDOW), [prompt],
                   SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert out.error is None and out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_context_beyond_the_sliding_window_is_refused(family):
    _, hf, target, drafter = family
    with pytest.raises(UnsupportedArchitectureError) as e:
        make_engine((hf, target, drafter), Mode.SYNC, context=TINY_WINDOW + 1)
    msg = str(e.value)
    assert "\n" not in msg and "mistral" in msg and f"{TINY_WINDOW}" in msg
    assert "--max-context" in msg


def test_check_context_allows_no_window_and_a_window_at_least_the_context():
    check_context(None, 1 << 20)
    check_context(4096, 4096)
    with pytest.raises(UnsupportedArchitectureError):
        check_context(4096, 4097)


# ---- refused families -----------------------------------------------------------------------
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
REFUSED = {
    "gemma2": {},
    "gemma3_text": {},
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "phi3": {},
}


def _assert_names(err: Exception, model_type: str) -> None:
    msg = str(err)
    assert "\n" not in msg and model_type in msg
    assert msg.endswith(f"supported: {supported_list()}")


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_other_families_are_refused_when_built(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **SMALL, **REFUSED[model_type])
    hf = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedArchitectureError) as e:
        Decoder.from_hf(hf)
    _assert_names(e.value, model_type)


@pytest.mark.parametrize("model_type", sorted(REFUSED) + ["gemma3", "gemma", "mistral3"])
def test_other_families_are_refused_from_config_json_before_any_weight(tmp_path, model_type):
    """The folder holds config.json alone: the refusal comes before reading weights."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": model_type, "architectures": ["SomethingForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_hf_model(tmp_path)
    _assert_names(e.value, model_type)
    assert "SomethingForCausalLM" in str(e.value)


def test_the_supported_list_is_the_tested_one():
    assert sorted(SUPPORTED) == ["llama", "mistral", "qwen2", "qwen3"]
    assert {"llama" if a == "llama3" else a for a in TINY_ARCHS} == set(SUPPORTED)
