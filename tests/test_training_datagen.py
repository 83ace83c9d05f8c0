"""datagen on a tiny random target: shards are complete, resumable and never duplicated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_d3d.testing import make_tiny_target
from sglang_d3d.training.datagen import DatagenConfig, interleave, run_datagen_config
from sglang_d3d.training.prompt_mix import build_mix
from sglang_d3d.training.shards import load_samples, read_manifest


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dg")
    target = make_tiny_target(root / "target")
    gsm = root / "train.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"w{5 + i} w{9 + i} w7"}) + "\n" for i in range(8)))
    return root, target, str(gsm)


def _cfg(root, target, gsm, **kw):
    base = dict(out_dir=str(root / "out"), target_path=target, gsm8k_path=gsm, max_prompts=10,
                shard_size=4, batch_size=3, max_new_tokens=6)
    return DatagenConfig(**{**base, **kw})


def test_interleave_keeps_ratio_and_everything():
    out = interleave(["a", "b", "c", "d", "e"], [1, 2], 2)
    assert out == [(0, "a"), (0, "b"), (1, 1), (0, "c"), (0, "d"), (1, 2), (0, "e")]


def test_mix_is_distinct_and_deterministic():
    mix = build_mix(0)
    assert len(mix) == len(set(mix)) >= 300
    assert mix == build_mix(0)


def test_datagen_resumes_without_duplicating_shards(tiny_setup):
    root, target, gsm = tiny_setup
    first = run_datagen_config(_cfg(root, target, gsm, max_shards=1))  # "interrupted" run
    assert first["shards"] == ["shard_00000.npz"]
    done = (root / "out" / "shard_00000.npz").stat().st_mtime_ns
    final = run_datagen_config(_cfg(root, target, gsm, batch_size=2))  # resume, other batch size
    assert final["shards"] == ["shard_00000.npz", "shard_00001.npz", "shard_00002.npz"]
    assert (root / "out" / "shard_00000.npz").stat().st_mtime_ns == done  # not rewritten
    again = run_datagen_config(_cfg(root, target, gsm))  # nothing left to do
    assert again["shards"] == final["shards"]
    samples = load_samples(root / "out")
    assert sorted(s.prompt_index for s in samples) == list(range(10))
    assert final["num_samples"] == 10
    assert final["num_response_tokens"] == sum(len(s.response) for s in samples)
    assert {s.source for s in samples} == {0, 1}
    assert all(0 < len(s.response) <= 6 for s in samples)
    assert all(s.ids.max() < 96 and s.ids.dtype == np.int64 for s in samples)


def test_datagen_refuses_folder_made_with_other_settings(tiny_setup):
    root, target, gsm = tiny_setup
    run_datagen_config(_cfg(root, target, gsm, out_dir=str(root / "other"), max_shards=1))
    with pytest.raises(ValueError, match="other settings"):
        run_datagen_config(_cfg(root, target, gsm, out_dir=str(root / "other"), max_new_tokens=9))
    assert read_manifest(root / "other")["generation"]["max_new_tokens"] == 6


def test_continuous_batching_matches_hf_greedy():
    import torch

    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.testing import tiny_hf_model
    from sglang_d3d.training.generation import generate_continuous

    hf = tiny_hf_model()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in (5, 9, 3, 7, 6)]
    got = generate_continuous(Decoder.from_hf(hf), prompts, 12, {2}, num_slots=2)
    for p, (resp, finished) in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
        assert resp == ref[: len(resp)] and (finished == (2 in ref))
        assert finished or len(resp) == 12
