"""The SGLang server backend's conversions (our engine API <-> sglang.Engine). The backend loop
itself runs inside real SGLang in test_sglang_e2e_cpu.py."""

from __future__ import annotations

import json

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import BranchPolicy, EngineConfig, Mode, SamplingParams, SpecConfig
from sglang_d3d.sglang_worker.backend_convert import (
    cycles_from_stats,
    event_from_chunk,
    plugin_env,
    sampling_params,
    sglang_ready_drafter,
    stats_from_meta,
)
from sglang_d3d.sglang_worker.options import PluginOptions

CFG = EngineConfig(
    spec=SpecConfig(block_size=4, branch_policy=BranchPolicy.ALL), draft_device="cuda:1",
    copy_ngram=3, corpus_tokens=1000,
)
REQ = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=8))


def test_plugin_environment_round_trips_through_the_plugins_reader():
    opts = PluginOptions.from_env(plugin_env(CFG))
    assert (opts.mode, opts.branch_policy, opts.draft_device, opts.copy_ngram,
            opts.corpus_tokens) == (Mode.ASYNC, BranchPolicy.ALL, "cuda:1", 3, 1000)


def test_sampling_parameters_in_sglangs_terms():
    greedy = sampling_params(SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(2,)))
    assert greedy == dict(
        temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=5, stop_token_ids=[2]
    )
    seeded = sampling_params(SamplingParams(temperature=0.8, top_k=20, seed=3))
    assert (seeded["top_k"], seeded["sampling_seed"]) == (20, 3)
    assert "frequency_penalty" not in seeded and "logit_bias" not in seeded
    ruled = sampling_params(SamplingParams(presence_penalty=0.5, logit_bias=((7, -2.0),)))
    assert (ruled["frequency_penalty"], ruled["presence_penalty"]) == (0.0, 0.5)
    assert ruled["logit_bias"] == {"7": -2.0}
    assert sampling_params(SamplingParams(temperature=0.5, min_p=0.1))["min_p"] == 0.1


def test_streamed_chunks_become_incremental_events_and_a_final_one():
    ev, sent = event_from_chunk(REQ, {"output_ids": [5, 6], "meta_info": {}}, 0, CFG, False)
    assert (ev.token_ids, ev.finished, sent) == ([5, 6], False, 2)
    meta = {
        "finish_reason": {"type": "length"},
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "spec_correct_drafts_histogram": [1, 0, 2],  # cycles accepting 0, 1, 2 drafts
    }
    ev, sent = event_from_chunk(
        REQ, {"output_ids": [5, 6, 7, 8, 9], "meta_info": meta}, 2, CFG, False
    )
    assert (ev.token_ids, ev.finished, ev.finish_reason, sent) == ([7, 8, 9], True, "length", 5)
    assert sorted(ev.stats.accepted_lengths) == [1, 3, 3]
    assert ev.stats.accepted_per_position == [2, 2] and ev.stats.drafts_per_position == [3, 3, 3]
    cycles = cycles_from_stats(ev.stats)
    assert [(c.num_drafts, c.num_accepted) for c in cycles] == [(3, 0), (3, 2), (3, 2)]


def test_aborts_are_ours_or_errors_with_sglangs_message():
    meta = {"finish_reason": {"type": "abort", "message": "D3D does not support min_p"}}
    ev, _ = event_from_chunk(REQ, {"output_ids": [], "meta_info": meta}, 0, CFG, aborted=False)
    assert (ev.finish_reason, ev.error) == ("error", "D3D does not support min_p")
    ev, _ = event_from_chunk(REQ, {"output_ids": [], "meta_info": meta}, 0, CFG, aborted=True)
    assert (ev.finish_reason, ev.error) == ("abort", None)


def test_stats_without_speculation_have_no_cycles():
    st = stats_from_meta({"prompt_tokens": 3, "completion_tokens": 4}, CFG)
    assert (st.num_cycles, st.prompt_tokens, st.generated_tokens) == (0, 3, 4)


def test_an_unmarked_drafter_gets_a_marked_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_CACHE_DIR", str(tmp_path / "cache"))
    target, drafter = tmp_path / "t", tmp_path / "d"
    target.mkdir()
    drafter.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (drafter / "config.json").write_text(json.dumps({"block_size": 4}))
    (drafter / "model.safetensors").write_bytes(b"weights")
    (drafter / "corpus.npz").write_bytes(b"answers")
    out = sglang_ready_drafter(drafter, target)
    assert out != drafter and json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert (out / "corpus.npz").read_bytes() == b"answers"  # the worker's copies need it
    assert json.loads((drafter / "config.json").read_text()) == {"block_size": 4}  # untouched
    assert sglang_ready_drafter(out, target) == out  # already marked: used as is
