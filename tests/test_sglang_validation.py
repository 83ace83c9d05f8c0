"""--speculative-algorithm D3D argument checks and defaults. SGLang hands these functions a
stand-in with plain attributes, so a SimpleNamespace is the real interface (the end-to-end path
through SGLang's own argument pipeline is in test_sglang_plugin.py). No sglang import needed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_d3d.config import EngineConfig
from sglang_d3d.sglang_worker.options import PluginOptions
from sglang_d3d.sglang_worker.validation import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    D3DArgumentError,
    check_vocab,
    resolve_server_args,
    validate_server_args,
)


@pytest.fixture
def folders(tmp_path):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir()
    drafter.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 96}))
    cfg = dict(source_layers=[0, 3], block_size=4, base_model_type="llama", vocab_size=96)
    (drafter / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    return target, drafter


def make_args(folders, **over):
    target, drafter = folders
    base = dict(
        model_path=str(target),
        speculative_draft_model_path=str(drafter),
        speculative_num_draft_tokens=None,
        speculative_num_steps=None,
        speculative_eagle_topk=None,
        attention_backend=None,
        prefill_attention_backend=None,
        decode_attention_backend=None,
        page_size=1,
        enable_dp_attention=False,
        pp_size=1,
        tp_size=1,
        speculative_adaptive=False,
        disaggregation_mode="null",
        enable_lora=None,
        device="cuda",
        disable_overlap_schedule=False,
        disable_cuda_graph=False,
        max_running_requests=None,
    )
    return SimpleNamespace(**{**base, **over})


def test_a_plain_configuration_passes_unchanged(folders):
    """Validation only reads: filling SGLang's fields is resolve_server_args' job."""
    for args in (make_args(folders), make_args(folders, attention_backend="flashinfer", device="cpu")):
        before = vars(args).copy()
        validate_server_args(args)
        assert vars(args) == before


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
        (dict(speculative_draft_model_path="org/some-hub-id"), "not a local D3D drafter folder"),
        (dict(attention_backend="flashmla"), "flashmla \\(--attention-backend.*not supported"),
        (dict(decode_attention_backend="dsa"), "dsa \\(--decode-attention-backend.*not supported"),
        # needs page size > 1, which D3D refuses
        (dict(attention_backend="trtllm_mha"), "trtllm_mha .*not supported.*flashinfer \\(CUDA\\)"),
        (dict(page_size=16), "--page-size 16 is not supported"),
        (dict(enable_dp_attention=True), "--enable-dp-attention is not supported"),
        (dict(pp_size=2), "--pp-size 1 only"),
        (dict(speculative_adaptive=True), "--speculative-adaptive"),
        (dict(disaggregation_mode="prefill"), "disaggregation is not supported"),
        (dict(enable_lora=True), "--enable-lora"),
        (dict(device="npu"), "not on npu"),
        (dict(speculative_num_draft_tokens=1), "must be >= 2"),
    ],
)
def test_unsupported_combinations_are_refused_with_a_clear_message(folders, over, message):
    with pytest.raises(D3DArgumentError, match=message):
        validate_server_args(make_args(folders, **over))


def test_tensor_parallelism_is_accepted(folders):
    """Every rank runs its own drafter; the worker broadcasts rank 0's block and verdicts
    (test_sglang_tp_cpu.py runs two ranks inside SGLang)."""
    validate_server_args(make_args(folders, tp_size=2))


def test_a_non_d3d_drafter_is_refused(folders):
    _, drafter = folders
    (drafter / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(D3DArgumentError, match="not a D3D drafter config"):
        validate_server_args(make_args(folders))


def test_a_drafter_without_model_type_gets_the_fix(folders):
    _, drafter = folders
    cfg = json.loads((drafter / "config.json").read_text())
    del cfg["model_type"]
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(D3DArgumentError, match="mark_for_sglang"):
        validate_server_args(make_args(folders))


def test_vocabulary_mismatch_is_refused(folders):
    target, _ = folders
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128}))
    with pytest.raises(D3DArgumentError, match="vocabulary of 96 tokens.*has 128"):
        validate_server_args(make_args(folders))


def test_the_worker_checks_the_vocabulary_of_a_target_given_by_hub_id(folders):
    """A hub id has no local config at argument time; the worker checks once SGLang has loaded
    the target."""
    _, drafter = folders
    validate_server_args(make_args(folders, model_path="org/some-hub-model"))  # nothing to read
    check_vocab(str(drafter), 96, "org/some-hub-model")
    with pytest.raises(D3DArgumentError, match="vocabulary of 96 tokens.*has 151936"):
        check_vocab(str(drafter), 151936, "org/some-hub-model")


def test_bad_plugin_environment_fails_at_validation(folders, monkeypatch):
    monkeypatch.setenv("SGLANG_D3D_BRANCH_POLICY", "sometimes")
    with pytest.raises(ValueError, match="SGLANG_D3D_"):
        validate_server_args(make_args(folders))


def test_resolution_sets_the_chain_shape_and_sync_schedule(folders):
    args = make_args(folders)
    resolve_server_args(args)
    assert args.speculative_num_draft_tokens == 4  # the drafter's trained block size
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (3, 1)
    assert args.disable_overlap_schedule
    assert args.max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS  # drafter slots
    args = make_args(folders, speculative_num_draft_tokens=8, max_running_requests=3)
    resolve_server_args(args)
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps) == (8, 7)
    assert args.max_running_requests == 3


def test_plugin_options_from_environment():
    opts = PluginOptions.from_env(
        {
            "SGLANG_D3D_MODE": "sync",
            "SGLANG_D3D_BRANCH_BUDGET": "2",
            "SGLANG_D3D_DRAFT_DEVICE": "cuda:1",
        }
    )
    assert (opts.mode.value, opts.branch_budget, opts.draft_device) == ("sync", 2, "cuda:1")
    assert opts.spec_config(5).num_drafts == 4
    assert opts.copy_ngram == 2  # the default: cycles of copies from the text where they fit
    assert PluginOptions.from_env({"SGLANG_D3D_COPY_NGRAM": "0"}).copy_ngram == 0
    with pytest.raises(ValueError, match="COPY_NGRAM must be >= 0"):
        PluginOptions.from_env({"SGLANG_D3D_COPY_NGRAM": "-1"})
    assert opts.corpus_tokens == EngineConfig.corpus_tokens  # the embedded engine's default
    assert PluginOptions.from_env({"SGLANG_D3D_CORPUS_TOKENS": "0"}).corpus_tokens == 0
    with pytest.raises(ValueError, match="CORPUS_TOKENS must be >= 0"):
        PluginOptions.from_env({"SGLANG_D3D_CORPUS_TOKENS": "-1"})
    with pytest.raises(ValueError, match="makes no sense"):
        PluginOptions.from_env({"SGLANG_D3D_MODE": "ar"})
