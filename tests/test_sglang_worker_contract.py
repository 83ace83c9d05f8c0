"""The SGLang worker's contract, without sglang, on CPU and (marked gpu) on CUDA: the drafter is
built the way the worker builds it beside SGLang's target, and every cycle hands the verify
function a block exactly as wide as the one SGLang reserved KV slots and positions for.
`benchmarks/gpu_check.sh` runs this file on the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_d3d.config import SpecConfig
from sglang_d3d.sglang_worker.cycle_step import check_width, from_rank0, verdicts_of, worker_cycle
from sglang_d3d.sglang_worker.drafter_loading import build_drafter, placement, shared_target_weights
from sglang_d3d.sglang_worker.requests import RequestTable
from sglang_d3d.speculative.corpus_lookup import CorpusIndex
from sglang_d3d.speculative.cycle import Plan, Verdict
from sglang_d3d.speculative.drafting import Drafting
from sglang_d3d.speculative.executor import Executor

BLOCK = 4
VOCAB = 96
PROMPTS = ([1, 40, 41, 42], [1, 50, 51, 52])
FIRST = (43, 53)  # SGLang's prefill token of each
# the drafter's corpus: each row's last three tokens, then one more, then the answer ends
CORPUS = ([41, 42, 43, 44], [51, 52, 53, 54])

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    return make_pair(tmp_path_factory.mktemp("pair"), block_size=BLOCK)


def _drafter_as_the_worker_builds_it(pair, device: str):
    """SGLang's runner says a bare "cuda"; the drafter goes on the same GPU and shares the
    target's embedding and head (no second copy)."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = pair
    gpu_id = torch.cuda.current_device() if device == "cuda" else 0
    target_device, draft_device = placement(device, "", gpu_id)
    sglang_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    sglang_model.to(target_device)
    embed, head = shared_target_weights(sglang_model, VOCAB, 1, target_device, draft_device)
    assert embed is not None, f"{target_device} and {draft_device} did not share weights"
    drafter = build_drafter(drafter_dir, target_dir, draft_device, torch.float32, embed, head)
    assert drafter._shared["embed"].weight.data_ptr() == embed.data_ptr()
    assert drafter._shared["head"].weight.data_ptr() == head.data_ptr()
    assert drafter.mask_embedding.device == draft_device
    return drafter, draft_device


def _req(rid: str, prompt: list[int], first: int):
    sp = SimpleNamespace(top_k=1, temperature=0.0, top_p=1.0, sampling_seed=None,
                         max_new_tokens=8, frequency_penalty=0.0, presence_penalty=0.0,
                         logit_bias=None)
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, output_ids=[first],
                           sampling_params=sp)


def _fixed_width_verify(widths: list[int], accepted: int):
    """SGLang's verify in miniature: a [bs, block] block or an error, as its logits view."""

    def verify(rows, tokens, proposals):
        check_width(tokens, BLOCK)
        widths.append(tokens.shape[1])
        return [Verdict(min(accepted, BLOCK - 1), 7) for _ in rows]

    return verify


@pytest.mark.parametrize("device", DEVICES)
def test_every_cycle_verifies_the_reserved_width(pair, device):
    drafter, draft_device = _drafter_as_the_worker_builds_it(pair, device)
    drafting = Drafting.create(drafter, 2, 128, SpecConfig(block_size=BLOCK))
    table = RequestTable(drafting, 2, VOCAB)
    reqs = [_req(f"r{i}", p, f) for i, (p, f) in enumerate(zip(PROMPTS, FIRST, strict=True))]
    rows = table.rows_for(reqs)
    for row, req in zip(rows, reqs, strict=True):
        table.sync(row, req)
    executor = Executor(draft_device)
    widths: list[int] = []
    try:
        # 1: every row copies one token from the corpus (shorter than the block), no drafter
        corpus = CorpusIndex(list(CORPUS))
        assert corpus.continuation([*PROMPTS[0], FIRST[0]], BLOCK - 1) == [44]
        out = worker_cycle(rows, drafting, _fixed_width_verify(widths, 1), executor,
                           Plan(BLOCK, overlap=True), copy_ngram=2, elsewhere=(corpus,))
        assert [o.tokens for o in out] == [[44, 7], [54, 7]]
        assert all(o.stats.copied for o in out)
        # 2: the D3D cycle on the drafter's executor (its stream on CUDA), pre-drafting
        for _ in range(2):
            out = worker_cycle(rows, drafting, _fixed_width_verify(widths, 0), executor,
                               Plan(BLOCK, overlap=True), copy_ngram=0)
            assert [o.tokens for o in out] == [[7], [7]] and not any(o.stats.copied for o in out)
    finally:
        executor.shutdown()
    assert widths == [BLOCK] * 3


class _SeenFromRank1:
    """SGLang's tensor-parallel group as rank 1 sees it: each broadcast brings rank 0's tensor."""

    def __init__(self, *from_rank0: torch.Tensor) -> None:
        self._next = iter(from_rank0)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        assert src == 0
        return t.copy_(next(self._next))


def test_a_tensor_parallel_rank_commits_rank_0s_block_and_verdict(pair):
    """Each rank drafts on its own; rank 1's drafts differ from rank 0's here, and it must still
    verify rank 0's block and commit rank 0's accepted drafts (worker.py `_verify`)."""
    drafter, device = _drafter_as_the_worker_builds_it(pair, "cpu")
    drafting = Drafting.create(drafter, 1, 128, SpecConfig(block_size=BLOCK))
    table = RequestTable(drafting, 1, VOCAB)
    req = _req("r0", PROMPTS[0], FIRST[0])
    (row,) = table.rows_for([req])
    table.sync(row, req)
    rank0_block = torch.tensor([[FIRST[0], 11, 12, 13]])
    group = _SeenFromRank1(rank0_block, torch.tensor([[2, 9]]))  # 2 drafts accepted, then 9
    own = []

    def verify(rows, tokens, proposals):  # the worker's _verify around SGLang's pass
        own.append(tokens[0, 1:].tolist())
        tokens = from_rank0(tokens, group, device)
        mine = torch.tensor([[0, 5]])  # what this rank's own verification decided
        return verdicts_of(tokens, from_rank0(mine, group, device), parallel=True)

    executor = Executor(device)
    try:
        (out,) = worker_cycle([row], drafting, verify, executor, Plan(BLOCK, overlap=True), 0)
    finally:
        executor.shutdown()
    assert own[0] != [11, 12, 13]  # this rank drafted something else
    assert out.tokens == [11, 12, 9]
    assert row.tokens[-3:] == [11, 12, 9]  # the drafter follows rank 0's tokens too
