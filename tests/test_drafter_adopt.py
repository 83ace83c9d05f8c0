"""A full-depth drafter copies its prefix cache from the target's instead of computing it."""

from __future__ import annotations

import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.offline import generate
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.packing import extend_pack
from sglang_d3d.models.target import TargetRunner

PROMPTS = [[5, 9, 7, 3, 11, 40, 41], [12, 13, 3], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def test_adopted_prefix_drafts_like_a_computed_one(tiny_prod_models):
    _, target, drafter = tiny_prod_models
    assert drafter.is_full_depth
    ctx = PROMPTS[0]
    t = TargetRunner(target, 1, 64)
    t.prefill(0, ctx)  # the target's cache holds the prompt
    computed, adopted = DraftRunner(drafter, 1, 64), DraftRunner(drafter, 1, 64)
    computed.prefill(0, ctx)
    adopted.adopt(0, t.cache, len(ctx))
    assert adopted.lengths[0] == computed.lengths[0] == len(ctx)
    pack = extend_pack([30], 4)
    a, c = adopted.run([(0, pack)])[0], computed.run([(0, pack)])[0]
    assert torch.allclose(a, c, atol=1e-6)


def _run(target, drafter, mode: Mode, adopt: bool, temperature: float = 0.0):
    cfg = EngineConfig(mode=mode, spec=SpecConfig(block_size=4), max_batch_size=3,
                       max_context=96)
    engine = SpecEngine(cfg, target, drafter)
    if engine.drafting is not None and not adopt:
        engine.drafting.target_cache = None
    elif engine.drafting is not None:
        assert engine.drafting.target_cache is engine.target.cache
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3)
    return generate(engine, PROMPTS, params)


def test_engine_output_and_drafts_do_not_change(tiny_prod_models):
    """Greedy: the same tokens as plain decoding, and the same accepted lengths cycle by cycle
    with the prefix copied as with it computed (the drafts themselves are unchanged)."""
    _, target, drafter = tiny_prod_models
    plain = [o.token_ids for o in _run(target, None, Mode.AR, False)]
    for mode in (Mode.SYNC, Mode.ASYNC):
        copied = _run(target, drafter, mode, True)
        computed = _run(target, drafter, mode, False)
        assert [o.token_ids for o in copied] == plain
        assert [o.stats.accepted_lengths for o in copied] == \
            [o.stats.accepted_lengths for o in computed]


def test_a_pruned_drafter_computes_its_prefix(tiny_models):
    _, target, drafter = tiny_models
    assert not drafter.is_full_depth
    engine = SpecEngine(EngineConfig(mode=Mode.SYNC, spec=SpecConfig(block_size=4)), target,
                        drafter)
    assert engine.drafting.target_cache is None
