"""A block copied from the drafter's corpus that stops before the block's end, inside real SGLang
on CPU (torch_native attention, tiny random Llama; cpu_harness). SGLang reserves KV slots and
builds positions for `block` tokens per row, so the worker pads every copy to the block
(worker.py); a copy left short made the verify logits' [bs, block, V] view fail."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import finished_whole

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

BLOCK = 4
PROMPT = [1, 40, 41]
MAX_NEW = 12


def _greedy(target: str, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def short_corpus_pair(tmp_path_factory):
    """The tiny pair, its drafter carrying a corpus of one answer that ends one token after the
    prompt's tail and the target's first token: the first cycle's copy is 1 token, not 3."""
    from sglang_d3d.models.corpus import write_corpus
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    target, drafter = make_pair(tmp_path_factory.mktemp("pair"), block_size=BLOCK)
    first = _greedy(target, PROMPT, 2)  # [g0, g1]
    answer = [*PROMPT[-2:], *first]  # (40, 41, g0) -> g1, then the answer ends
    print_ = json.loads((Path(drafter) / "config.json").read_text())["target_fingerprint"]
    write_corpus(drafter, [np.array(answer)], print_)
    return target, drafter, answer, first


@pytest.fixture(scope="module")
def run(short_corpus_pair):
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env

    target, drafter, _, _ = short_corpus_pair
    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.compare", target,
           drafter, json.dumps([PROMPT]), str(MAX_NEW)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE-RESULT ")]
    assert lines, f"run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("COMPARE-RESULT "))


def test_the_first_copy_is_shorter_than_the_block(short_corpus_pair):
    """The premise: the worker's first cycle copies one token from the corpus, not block - 1."""
    from sglang_d3d.speculative.corpus_lookup import CorpusIndex

    _, _, answer, first = short_corpus_pair
    copy = CorpusIndex([answer]).continuation([*PROMPT, first[0]], BLOCK - 1)
    assert copy == [first[1]]


def test_a_short_copy_is_verified_at_the_block_width_and_output_is_unchanged(run,
                                                                             short_corpus_pair):
    first = short_corpus_pair[3]
    assert run["baseline"][0][:2] == first  # SGLang's greedy tokens are the ones the corpus holds
    d3d = run["d3d"]["g0"]
    assert d3d["error"] is None and d3d["reason"] == "length"
    assert d3d["ids"] == run["baseline"][0]
    sampled = run["sampled"]["s0"]
    assert finished_whole(sampled, MAX_NEW)
