"""Shared fixtures: tiny random model pairs in float64 (no argmax ties between a 1-token and
a 16-token forward pass), built in seconds, never downloaded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# calibration results (engine/calibration_cache.py) go to a folder of this run, not the user's
os.environ.setdefault("D3D_CALIBRATION_CACHE", tempfile.mkdtemp(prefix="d3d-test-calibration-"))
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def sglang_baseline_cache(tmp_path_factory) -> str:
    """A folder where real-SGLang comparisons keep SGLang alone's output (cpu_harness/compare.py
    `kept_baseline`): modules that compare the same tiny target on the same prompts start
    SGLang alone once between them."""
    return str(tmp_path_factory.mktemp("sglang_baselines"))


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> tuple[str, str]:
    from sglang_d3d.testing import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def json_pair(tiny_pair_dir, tmp_path_factory) -> tuple[str, str]:
    """The tiny pair with a tokenizer whose tokens can write JSON (`tiny_pieces`)."""
    import shutil

    from sglang_d3d.testing import tiny_tokenizer

    target = tmp_path_factory.mktemp("json_target")
    shutil.copytree(tiny_pair_dir[0], target, dirs_exist_ok=True)
    tiny_tokenizer(pieces=True).save_pretrained(target)
    return str(target), tiny_pair_dir[1]


@pytest.fixture(scope="session")
def tiny_models(tiny_pair_dir):
    """(hf_model, target Decoder, drafter) in float64, llama family."""
    return _load(*tiny_pair_dir)


@pytest.fixture(scope="session")
def tiny_qwen_models(tmp_path_factory):
    from sglang_d3d.testing import make_tiny_pair

    return _load(*make_tiny_pair(tmp_path_factory.mktemp("tinyq"), arch="qwen3", seed=1))


@pytest.fixture(scope="session")
def tiny_prod_models(tmp_path_factory):
    """The shipped drafter's layout on the tiny llama target (same weights as tiny_models'):
    full depth (so its prefix cache is copied from the target's), trained at block 16 with
    mixed blocks down to 4 (assets/drafter/config.json), so an engine block below 4 still
    drafts packs of 4 and pre-drafts 16-token branches; its deltas stored in int4, as
    shipped."""
    from sglang_d3d.testing import make_tiny_pair

    pair = make_tiny_pair(tmp_path_factory.mktemp("tinyprod"), block_size=16, min_block=4,
                          layer_ids=(0, 1, 2, 3), store="int4")
    return _load(*pair)


# Block layouts the sampling and fault tests run: the tiny drafter at its own block,
# and the production layout (a block-16 drafter trained down to block 4).
LAYOUT_MODELS = {"tiny": "tiny_models", "production": "tiny_prod_models"}


def layout_models(request, layout: str):
    """(hf_model, target Decoder, drafter) of a layout named in LAYOUT_MODELS."""
    return request.getfixturevalue(LAYOUT_MODELS[layout])


def _load(target_dir: str, drafter_dir: str):
    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model

    hf = load_hf_model(Path(target_dir)).double()
    target = Decoder.from_hf(hf)
    return hf, target, D3DDrafter.from_pretrained(drafter_dir, target)


def reference_greedy(hf_model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Target-only greedy decoding with plain HF forward passes (no cache, no speculation)."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


def naive_rule(logits: torch.Tensor, written: list[int], params, prompt=()) -> torch.Tensor:
    """Token by token, as the documentation states them: [V] float64. OpenAI's logit_bias, then
    vLLM's repetition_penalty over the prompt and the output, then OpenAI's frequency and
    presence penalties over the output."""
    out = logits.double().clone()
    for t, b in params.logit_bias:
        out[t] += b
    rp = params.repetition_penalty
    for t in set(written) | set(prompt):
        out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
    for t in set(written):
        out[t] -= params.frequency_penalty * written.count(t) + params.presence_penalty
    return out


def reference_ruled(hf_model, prompt: list[int], n: int, params) -> list[int]:
    """Target-only greedy decoding under those rules, with plain HF forward passes."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            tok = int(naive_rule(logits, out, params, prompt).argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.fixture(autouse=True)
def _grad_mode_is_on():
    """Some imported libraries (SGLang's runtime among them) switch autograd off process-wide
    at import; tests that train must not depend on which test ran first."""
    torch.set_grad_enabled(True)
    yield
