"""D3D inside real SGLang on CPU: SGLang's own scheduler, model runner, KV pool and radix cache
(torch_native attention, tiny random Llama), with the CPU harness's import shims and two
pure-torch kernel fallbacks. One subprocess runs SGLang without speculation and then with D3D
through backend.SGLangEngineLoop; this test compares the two, and compares both with the
embedded engine on the same prompts and drafter."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    return make_pair(tmp_path_factory.mktemp("pair"), block_size=BLOCK)


@pytest.fixture(scope="module")
def run(pair):
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env

    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.e2e", *pair, str(BLOCK)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E-RESULT ")]
    assert lines, f"e2e run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("E2E-RESULT "))


def test_greedy_d3d_in_sglang_equals_sglang_without_speculation(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(run["prompts"]))]
    assert [r["ids"] for r in d3d] == run["baseline"]
    assert all(r["reason"] == "length" and r["error"] is None for r in d3d)
    # several tokens per verify cycle happened, so the drafts were really used
    assert any(n > 1 for r in d3d for n in r["accepted_lengths"])
    # streaming: more than one event per request
    assert all(r["events"] > 1 for r in d3d)


def test_sglang_and_embedded_engine_agree(run, pair):
    tokens, accepted, copies = _embedded(pair, run["prompts"])
    assert tokens == run["baseline"]
    # tiny models repeat themselves, so both ran cycles of blocks copied from the text
    assert copies > 0
    for i in range(len(run["prompts"])):
        # SGLang reports cycles by accepted drafts (a histogram), so compare as multisets
        assert sorted(run["d3d"][f"g{i}"]["accepted_lengths"]) == sorted(accepted[i])


def test_sampling_runs_inside_sglang(run):
    for ids in run["seeded"]:
        assert len(ids) == 16 and all(0 <= t < 96 for t in ids)


def test_unverifiable_request_is_refused_with_a_message(run):
    finish = run["refused"]["finish"]
    assert finish["type"] == "abort"
    assert "D3D does not support repetition_penalty" in finish["message"]


def test_ignore_eos_reaches_sglang(run):
    stopped, ignored = run["eos"]["e0"], run["eos"]["e1"]
    assert stopped["reason"] == "stop" and stopped["ids"] == [2]
    assert ignored["reason"] == "length" and ignored["ids"] == [2] * 16
    assert any(n > 1 for n in ignored["accepted_lengths"])  # D3D's cycles carried them


def test_penalties_and_bias_in_sglang_equal_sglang_without_speculation(run):
    """SGLang's own sampler applies the rules token by token; the D3D worker applies them to
    every row of a verify block with that row's drafts counted (speculative/penalties.py)."""
    ruled = [run["ruled"][f"r{i}"] for i in range(len(run["prompts"]))]
    assert [r["ids"] for r in ruled] == run["ruled_baseline"]
    assert run["ruled_baseline"] != run["baseline"]  # the rules changed the output
    assert all(r["reason"] == "length" and r["error"] is None for r in ruled)
    assert any(n > 1 for r in ruled for n in r["accepted_lengths"])


def _embedded(pair, prompts):
    """The embedded engine (sync draft + async branches) on the same pair and prompts."""
    from sglang_d3d.api import GenerationRequest
    from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
    from sglang_d3d.engine.engine import SpecEngine
    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model

    torch.set_grad_enabled(False)
    target = Decoder.from_hf(load_hf_model(Path(pair[0])))
    drafter = D3DDrafter.from_pretrained(Path(pair[1]), target)  # ignores the HF keys SGLang needs
    # SGLang's worker drafts on full-precision weights; the same drafts need the same weights.
    # Its cycles of copies from the text verify a block's worth (BLOCK - 1 copied tokens).
    cfg = EngineConfig(
        mode=Mode.ASYNC, spec=SpecConfig(block_size=BLOCK), max_batch_size=4, max_context=256,
        draft_weights="full", lookup_tokens=BLOCK - 1,
    )
    engine = SpecEngine(cfg, target, drafter)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(str(i), p, params))
    tokens = {str(i): [] for i in range(len(prompts))}
    accepted, copies = {}, 0
    while engine.has_work():
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
            if ev.finished:
                accepted[int(ev.request_id)] = ev.stats.accepted_lengths
                copies += ev.stats.copy_cycles
    engine.shutdown()
    return [tokens[str(i)] for i in range(len(prompts))], accepted, copies
