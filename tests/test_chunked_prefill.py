"""Chunked and packed prefill: same cache and outputs as one whole-prompt pass; a long prompt
is prefilled between the decode cycles of running requests instead of stalling them."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy
from engine_helpers import make_engine

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.offline import generate
from sglang_d3d.engine.scheduler import plan_chunks
from sglang_d3d.models.target import TargetRunner


def test_plan_chunks_fifo_under_budget():
    assert plan_chunks([100, 5], 64) == [64]
    assert plan_chunks([10, 5, 30], 64) == [10, 5, 30]
    assert plan_chunks([10, 5, 80], 64) == [10, 5, 49]
    assert plan_chunks([], 64) == []


def _decode_after(runner: TargetRunner, slot: int) -> torch.Tensor:
    """logits [1, 3, V] of a 3-token block after the slot's cache."""
    return runner.forward_block([slot], torch.tensor([[7, 8, 9]]))


@pytest.mark.parametrize("sizes", [[7, 5, 13], [1, 24], [25]])
def test_chunked_prefill_equals_whole_prompt(tiny_models, sizes):
    target = tiny_models[1]
    prompt = torch.randint(3, 96, (sum(sizes),), generator=torch.Generator().manual_seed(1)).tolist()
    whole, chunked = TargetRunner(target, 1, 64), TargetRunner(target, 1, 64)
    want = whole.prefill(0, prompt)
    start = 0
    for n in sizes:
        got = chunked.prefill_chunks([(0, start, prompt[start : start + n])])[0]
        start += n
    assert chunked.lengths == whole.lengths == [len(prompt)]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_decode_after(chunked, 0), _decode_after(whole, 0))


def test_packed_prompts_equal_separate_prefills(tiny_models):
    target = tiny_models[1]
    prompts = {3: [5, 6, 7, 8, 9], 0: [40], 2: list(range(10, 30))}  # slot -> prompt
    alone, packed = TargetRunner(target, 4, 64), TargetRunner(target, 4, 64)
    want = {slot: alone.prefill(slot, p) for slot, p in prompts.items()}
    got = packed.prefill_chunks([(slot, 0, p) for slot, p in prompts.items()])
    for i, slot in enumerate(prompts):
        torch.testing.assert_close(got[i], want[slot])
        torch.testing.assert_close(_decode_after(packed, slot), _decode_after(alone, slot))


class Driver:
    """Steps an engine by hand; records which request got tokens, in order."""

    def __init__(self, eng) -> None:
        self.eng, self.tokens, self.order = eng, {}, []

    def submit(self, rid: str, prompt: list[int], max_new: int) -> None:
        self.tokens[rid] = []
        self.eng.submit(GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=max_new)))

    def step(self) -> None:
        for ev in self.eng.step():
            assert ev.error is None
            self.tokens[ev.request_id].extend(ev.token_ids)
            if ev.token_ids:
                self.order.append(ev.request_id)

    def run(self) -> None:
        while self.eng.has_work():
            self.step()


LONG = [3 + (7 * i) % 93 for i in range(96)]


@pytest.mark.parametrize("mode", [Mode.AR, Mode.ASYNC])
def test_long_prompt_does_not_stall_running_streams(tiny_models, mode):
    d = Driver(make_engine(tiny_models, mode, prefill_chunk=8))
    d.submit("short", [5, 6, 7], 150)
    d.step()  # prefill: first token
    d.step()  # decoding
    seen = len(d.order)
    d.submit("long", LONG, 8)
    d.run()
    during = d.order[seen : d.order.index("long")]
    # 12 chunks of 8: a decode cycle after each but the last (old engine: none at all)
    assert during == ["short"] * (len(LONG) // 8 - 1)
    assert d.tokens["short"] == reference_greedy(tiny_models[0], [5, 6, 7], 150)
    assert d.tokens["long"] == reference_greedy(tiny_models[0], LONG, 8)


def test_prompts_arriving_together_share_one_pass(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, prefill_chunk=8, max_prefill_tokens=32)
    passes = []
    real = eng.target.prefill_chunks

    def spy(chunks):
        passes.append([len(ids) for _, _, ids in chunks])
        return real(chunks)

    eng.target.prefill_chunks = spy
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 40, 13, 50, 14, 60, 15]]
    outs = generate(eng, prompts, SamplingParams(max_new_tokens=12))
    assert passes == [[4, 3, 7]]
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(tiny_models[0], p, 12)
    passes.clear()
    (out,) = generate(eng, [LONG], SamplingParams(max_new_tokens=4))
    assert passes == [[32], [32], [32]]  # nobody decoding: passes of max_prefill_tokens
    assert out.token_ids == reference_greedy(tiny_models[0], LONG, 4)
