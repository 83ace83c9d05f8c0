"""A drafter fault is charged to the request that caused it: batched with requests
whose drafting fails, the others keep real drafts, even past MAX_DRAFTER_FAULTS cycles."""

from __future__ import annotations

import pytest
import torch

import sglang_d3d.speculative.sampling as sampling_mod
from sglang_d3d.config import SamplingParams, SpecConfig
from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.speculative.drafting import MAX_DRAFTER_FAULTS, Drafting
from sglang_d3d.speculative.sampling import Role, make_generator

BLOCK = 4


def _rows(drafting, prompts, params):
    return [drafting.start(slot, prompt, p, make_generator(slot))
            for slot, (prompt, p) in enumerate(zip(prompts, params))]


def _cycles(drafting, rows, n):
    """n cycles: draft, then 'verify' by accepting one draft (the target's token is made up)."""
    for _ in range(n):
        drafting.ensure_drafts(rows, BLOCK)
        for s in rows:
            run = s.draft[:1] + [7]
            before = list(s.tokens)
            drafting.advance(s, 1, 7, BLOCK)
            assert s.tokens == before + run  # drafting keeps the request's tokens itself


@pytest.mark.parametrize("fault", ["sampling", "pass"])
def test_one_faulting_request_never_costs_the_others_their_drafts(tiny_models, monkeypatch, fault):
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    runner = DraftRunner(tiny_models[2], 3, 128)
    drafting = Drafting(runner, SpecConfig(block_size=BLOCK))
    rows = _rows(drafting, [[5, 6, 7], [9, 10, 11, 12], [3, 4]], [greedy, hot, greedy])
    bad = rows[1]
    if fault == "sampling":
        # What a CPU generator meeting CUDA probabilities did: the draw raises for one request.
        real = sampling_mod.sample_rows  # what drafts are drawn with (draw_drafts)

        def sample_rows(q, generator):
            if generator is bad.generator.for_role(Role.DRAFTING):  # its drafting stream
                raise RuntimeError("Expected a 'cuda' device type for generator")
            return real(q, generator)

        monkeypatch.setattr(sampling_mod, "sample_rows", sample_rows)
    else:
        # The batched pass itself raises whenever the bad request's slot is in it.
        real_run = runner.run

        def run(packs):
            if any(slot == bad.slot for slot, _ in packs):
                raise RuntimeError("drafter exploded on this request's input")
            return real_run(packs)

        runner.run = run
    _cycles(drafting, rows, MAX_DRAFTER_FAULTS + 3)
    for s in (rows[0], rows[2]):
        assert s.faults == 0
        assert s.draft_q is not None  # real drafts
    assert bad.faults == MAX_DRAFTER_FAULTS and bad.draft_q is None  # it alone stopped


def test_a_fault_while_following_the_outcome_keeps_the_history(tiny_models, monkeypatch):
    """advance() faulting (e.g. sampling the next draft from a hit branch) resets that request's
    drafter cache and queues its whole history, including this cycle's tokens."""
    drafting = Drafting(DraftRunner(tiny_models[2], 1, 128), SpecConfig(block_size=BLOCK))
    rows = _rows(drafting, [[5, 6, 7]], [SamplingParams(temperature=0.0)])
    s = rows[0]
    drafting.ensure_drafts(rows, BLOCK)
    run = s.draft[:2] + [7]
    monkeypatch.setattr(drafting, "_follow", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    assert drafting.advance(s, 2, 7, BLOCK) is None
    assert s.tokens == [5, 6, 7] + run
    assert s.pending == s.tokens and s.draft is None and s.faults == 1
    assert drafting.runner.lengths[s.slot] == 0


def test_request_random_streams_are_per_device_and_seeded():
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(4, generator=a.on("cpu")), torch.rand(4, generator=b.on("cpu")))
    assert a.on("cpu") is a.on(torch.device("cpu"))  # one generator per device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampled_drafts_on_cuda_use_a_cuda_generator(tiny_models):
    """A seeded CPU generator meeting CUDA probabilities in drafting would make sampled
    requests silently draft placeholders on GPUs."""
    from sglang_d3d.speculative.sampling import sample, sample_rows

    q = torch.softmax(torch.randn(5, 96, device="cuda"), -1)
    a, b = make_generator(3), make_generator(3)
    assert sample_rows(q, a) == sample_rows(q, b)
    assert 0 <= sample(q[0], a) < 96
    assert a.on("cuda").device.type == "cuda"
