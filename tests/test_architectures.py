"""Every supported target family is served exactly, and every other one is refused by name.

Supported (models/architectures.py): Llama (also with Llama 3's rope scaling and a vocabulary
above uint16), Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms). For each, on
a tiny random target in float64: the engine's greedy output with a drafter equals plain `ar`
decoding and transformers' own greedy `generate` on the same weights; the drafter built from
the target (by the engine's loader and by the SGLang plugin's) computes the target's layers
exactly on clean tokens; and `d3d datagen` -> two training steps -> the engine runs through.
Gemma 2/3, MoE targets and Phi-3 are refused in one line, from config.json or a built model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Family:
    arch: str
    target_dir: str
    hf: object  # the transformers model, float64
    target: Decoder  # over the same weights
    drafter: D3DDrafter  # small random deltas over two layers

    @property
    def models(self) -> tuple:
        return self.hf, self.target, self.drafter

    @property
    def vocab(self) -> int:
        return self.target.arch.vocab_size


def _prompts(vocab: int) -> list[list[int]]:
    """Three prompts, each with the vocabulary's last id (above uint16 in the large one)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() + [vocab - 1] for n in (5, 11, 1)]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory) -> Family:
    """Built once per family, in float64 (no argmax ties between passes of other shapes)."""
    arch = request.param
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp(arch), arch=arch, seed=2,
                                             vocab=VOCAB.get(arch, TINY_VOCAB))
    hf = load_hf_model(Path(target_dir)).double()
    target = Decoder.from_hf(hf)
    return Family(arch, target_dir, hf, target, D3DDrafter.from_pretrained(drafter_dir, target))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate with its own cache, never stopping early."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_exact(f: Family, drafter: D3DDrafter) -> None:
    """sync mode with `drafter` == ar == transformers' generate, token for token."""
    models = (f.hf, f.target, drafter)
    prompts = _prompts(f.vocab)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    ar = generate(make_engine(models, Mode.AR), prompts, params)
    sync = generate(make_engine(models, Mode.SYNC, block=4), prompts, params)
    for prompt, a, s in zip(prompts, ar, sync, strict=True):
        assert a.error is None and s.error is None
        assert s.token_ids == a.token_ids == hf_greedy(f.hf, prompt, NEW_TOKENS), f.arch


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_greedy_with_a_drafter_equals_ar_and_transformers(family):
    assert_exact(family, family.drafter)


def _causal(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [1, T] -> (positions [1, T], causal mask [1, T, T])."""
    t = ids.shape[1]
    return torch.arange(t).unsqueeze(0), torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0)


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_a_full_depth_drafter_is_the_target_on_clean_tokens(family):
    """A fresh drafter (zero deltas) over every layer: its clean-token logits are the
    target's, so biases, q/k norms and rope scaling reach the drafter's path too."""
    f = family
    drafter = D3DDrafter.init_from_target(f.target, None, block_size=4, rank=4, alpha=4.0)
    assert drafter.cfg.base_model_type == f.hf.config.model_type and drafter.is_full_depth
    ids = torch.tensor([_prompts(f.vocab)[1]])  # [1, T]
    pos, causal = _causal(ids)
    with torch.no_grad():
        want = f.hf(ids).logits
        ours = f.target(ids, Batch(pos, causal))
        drafted = drafter.logits(drafter.hidden(ids, pos, causal))
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(drafted, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_the_fast_fp32_paths_match_transformers(family):
    """In fp32 on a CPU the target and the drafter run fused, packed projections (biases
    included); they agree with transformers up to float rounding."""
    hf = load_hf_model(Path(family.target_dir))
    target = Decoder.from_hf(hf)
    drafter = D3DDrafter.init_from_target(target, None, block_size=4, rank=4, alpha=4.0)
    ids = torch.tensor([_prompts(family.vocab)[1]])
    pos, causal = _causal(ids)
    with torch.no_grad():
        want = hf(ids).logits
        fast = target(ids, Batch(pos, causal), fast=True)
        drafted = drafter.logits(drafter.hidden(ids, pos, causal, fast=True), fast=True)
    torch.testing.assert_close(fast, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drafted, want, rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_the_sglang_plugin_builds_the_same_drafter_from_the_files(family, tmp_path):
    """The SGLang worker's loader (target on the meta device, the drafter's layers read from
    the target's safetensors) gives the drafter the engine loads, for every family."""
    from sglang_d3d.models.drafter import MASK_ID
    from sglang_d3d.sglang_worker.drafter_loading import build_drafter

    drafter_dir = str(tmp_path / "drafter")
    family.drafter.save_pretrained(drafter_dir, dtype=torch.float64)
    built = build_drafter(drafter_dir, family.target_dir, "cpu", torch.float64)
    ids = torch.tensor([_prompts(family.vocab)[1][:6] + [MASK_ID] * 3])  # [1, 9]
    pos, causal = _causal(ids)
    mask = causal | (ids == MASK_ID).unsqueeze(1) & (ids == MASK_ID).unsqueeze(2)
    with torch.no_grad():
        got = built.logits(built.hidden(ids, pos, mask))
        want = family.drafter.logits(family.drafter.hidden(ids, pos, mask))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# ---- sliding window -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_sliding_window_target_is_exact_up_to_its_window(family):
    """A request filling the whole window: transformers attends within the window, we attend
    over everything; inside the window the two are the same."""
    prompt = (_prompts(TINY_VOCAB)[0] * TINY_WINDOW)[: TINY_WINDOW - NEW_TOKENS]
    out = generate(make_engine(family.models, Mode.SYNC, context=TINY_WINDOW), [prompt],
                   SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert out.error is None and out.token_ids == hf_greedy(family.hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_context_beyond_the_sliding_window_is_refused(family):
    for mode in (Mode.AR, Mode.SYNC):
        with pytest.raises(UnsupportedArchitectureError) as e:
            make_engine(family.models, mode, context=TINY_WINDOW + 1)
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


def test_the_sglang_plugin_refuses_another_family_before_building_it(tmp_path):
    from sglang_d3d.sglang_worker.drafter_loading import build_drafter

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        build_drafter(tmp_path / "no-drafter", tmp_path, "cpu", torch.float32)
    _assert_names(e.value, "qwen3_moe")


def test_the_cli_refuses_another_family_in_one_line(tmp_path, capsys):
    from sglang_d3d.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    assert main(["generate", "--target", str(tmp_path), "--mode", "ar", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("d3d: unsupported target architecture phi3")


def test_the_supported_list_is_the_tested_one():
    assert sorted(SUPPORTED) == ["llama", "mistral", "qwen2", "qwen3"]
    assert {"llama" if a == "llama3" else a for a in TINY_ARCHS} == set(SUPPORTED)


# ---- the drafter pipeline -------------------------------------------------------------------
@pytest.mark.parametrize("family", TINY_ARCHS, indirect=True)
def test_datagen_train_and_serve_each_family(family, tmp_path):
    """`d3d datagen` on the target, two training steps, and the trained drafter served
    exactly (its greedy output is ar's and transformers')."""
    from sglang_d3d.training.datagen import DatagenConfig, run_datagen_config
    from sglang_d3d.training.shards import load_samples
    from sglang_d3d.training.train import TrainConfig, Trainer

    top = family.vocab - 1  # above uint16 in the large vocabulary
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question": f"w{5 + i} w{top - i} w7"}) + "\n"
                                 for i in range(8)))
    data = tmp_path / "data"
    run_datagen_config(DatagenConfig(out_dir=str(data), target_path=family.target_dir,
                                     gsm8k_path=str(questions), max_prompts=8, shard_size=8,
                                     batch_size=8, max_new_tokens=8))
    assert max(int(s.ids.max()) for s in load_samples(data)) == top
    export = tmp_path / "drafter"
    final = Trainer(TrainConfig(
        data_dir=str(data), out_dir=str(tmp_path / "run"), target_path=family.target_dir,
        layers=(0, 3), block_size=4, num_anchors=3, rank=4, alpha=4.0, batch_size=4,
        max_steps=2, warmup_steps=1, eval_every=2, heldout_every=4, eval_samples=2, lr=1e-2,
        export_to=str(export),
    )).run()
    assert final["step"] == 2 and 1.0 <= final["accept_len"] <= 4.0
    assert_exact(family, D3DDrafter.from_pretrained(export, family.target))
