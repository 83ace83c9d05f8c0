"""Verify inputs and accept/rollback bookkeeping against SGLang's real memory structures
(ReqToTokenPool, TokenToKVPoolAllocator, MHATokenToKVPool built small on CPU), and the mapping of
SGLang's sampling parameters onto the verification maths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_d3d.sglang_worker.cpu_harness import install

install()
pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams  # noqa: E402

from sglang_d3d.config import SamplingParams  # noqa: E402
from sglang_d3d.sglang_worker.accept import (  # noqa: E402
    to_sampling_params,
    unsupported_reason,
    verify_row,
)
from sglang_d3d.sglang_worker.verify_io import (  # noqa: E402
    block_cache_loc,
    block_positions,
    commit_rows,
)
from sglang_d3d.speculative.penalties import reshape_chain, reshape_rows  # noqa: E402
from sglang_d3d.speculative.verify import greedy_accept  # noqa: E402

B = 4  # block: last token + 3 drafts


@pytest.fixture
def pools():
    """Two requests with committed lengths 5 and 3, each with 2*B reserved slots beyond them,
    laid out the way SGLang's prefill and spec-decode reservation leave them."""
    req_pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=64, page_size=1, dtype=torch.float32, head_num=1, head_dim=2, layer_num=1,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    alloc = TokenToKVPoolAllocator(
        size=64, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False
    )
    rows = req_pool.alloc_rows(2)
    lens = [5, 3]
    for row, n in zip(rows, lens, strict=True):
        req_pool.write((row, slice(0, n + 2 * B)), alloc.alloc(n + 2 * B).to(torch.int32))
    # K of a committed prompt position p holds p (so reads show which position a slot holds)
    for row, n in zip(rows, lens, strict=True):
        kv.get_key_buffer(0)[req_pool.req_to_token[row, :n].long()] = torch.arange(n).float()[
            :, None, None
        ]
    return SimpleNamespace(
        req_pool=req_pool, kv=kv, alloc=alloc,
        rows=torch.tensor(rows), lens=torch.tensor(lens, dtype=torch.int64),
    )  # fmt: skip


def test_verify_block_reads_positions_and_reserved_slots(pools):
    pos = block_positions(pools.lens, B).view(2, B)
    assert pos.tolist() == [[5, 6, 7, 8], [3, 4, 5, 6]]
    loc = block_cache_loc(pools.req_pool.req_to_token, pools.rows, pools.lens, B).view(2, B)
    for i in range(2):
        row, n = int(pools.rows[i]), int(pools.lens[i])
        assert loc[i].tolist() == pools.req_pool.req_to_token[row, n : n + B].tolist()
    assert len(set(loc.view(-1).tolist())) == 2 * B  # no slot shared between requests


def test_accept_commits_a_prefix_of_the_block_without_moving_kv(pools):
    free_before = pools.alloc.available_size()
    loc = block_cache_loc(pools.req_pool.req_to_token, pools.rows, pools.lens, B)
    # the verify pass writes K = position into every block slot
    pools.kv.get_key_buffer(0)[loc] = block_positions(pools.lens, B).float()[:, None, None]
    # request 0 accepts 2 of its 3 drafts, request 1 none; each adds the target's own token
    runs = [[11, 12, 90], [91]]
    out, accept_lens, new_lens = commit_rows(runs, pools.lens, B, "cpu")
    assert out.view(2, B).tolist() == [[11, 12, 90, 0], [91, 0, 0, 0]]  # stride B, padded
    assert accept_lens.tolist() == [3, 1] and accept_lens.dtype == torch.int32
    assert new_lens.tolist() == [8, 4]
    for i in range(2):
        row, n = int(pools.rows[i]), int(new_lens[i])
        committed = pools.req_pool.req_to_token[row, :n].long()
        # the committed prefix reads positions 0..n-1 in order: accepted KV is already in place
        assert pools.kv.get_key_buffer(0)[committed][:, 0, 0].tolist() == list(range(n))
    # rollback is SGLang's committed length alone: the next block starts at the new length and
    # reuses the rejected slots; no KV slot was allocated or freed for the verify
    nxt = block_cache_loc(pools.req_pool.req_to_token, pools.rows, new_lens, B).view(2, B)
    old = loc.view(2, B)
    assert nxt[0, :1].tolist() == old[0, 3:].tolist()
    assert nxt[1, :3].tolist() == old[1, 1:].tolist()
    assert pools.alloc.available_size() == free_before


def _req(**sampling):
    return SimpleNamespace(rid="r1", sampling_params=SGLangParams(**sampling), return_logprob=False)


def test_sglang_sampling_parameters_map_onto_ours():
    greedy = to_sampling_params(SGLangParams(temperature=0.0, max_new_tokens=7), vocab_size=96)
    assert greedy.greedy and greedy.max_new_tokens == 7
    p = to_sampling_params(SGLangParams(temperature=0.7, top_p=0.9, sampling_seed=3), 96)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.9, 0, 3)  # no top-k: 0
    assert to_sampling_params(SGLangParams(temperature=1.0, top_k=5), 96).top_k == 5


@pytest.mark.parametrize(
    ("sampling", "name"),
    [
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(json_schema='{"type": "object"}'), "structured output"),
        (dict(min_new_tokens=3), "min_new_tokens"),
    ],
)
def test_requests_that_cannot_be_verified_exactly_are_named(sampling, name):
    assert name in unsupported_reason(_req(**sampling))
    assert unsupported_reason(_req(temperature=0.8, top_p=0.9, top_k=20)) is None
    ruled = _req(frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={"5": 1.0}, min_p=0.1)
    assert unsupported_reason(ruled) is None  # verified with the rules (speculative/penalties.py)


def test_sglang_penalties_and_bias_map_onto_ours():
    sp = SGLangParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=-0.3,
                      logit_bias={"7": 2.0, "5": -1.0})
    p = to_sampling_params(sp, 96)
    assert p.greedy and (p.frequency_penalty, p.presence_penalty) == (0.5, -0.3)
    assert p.logit_bias == ((5, -1.0), (7, 2.0))
    assert not to_sampling_params(SGLangParams(temperature=0.7), 96).reshapes_logits
    assert to_sampling_params(SGLangParams(temperature=0.7, min_p=0.2), 96).min_p == 0.2


def test_worker_rows_are_reshaped_only_where_asked():
    logits = torch.randn(2, 3, 96)  # two requests, blocks of 2 drafts
    drafts = torch.tensor([[4, 4], [9, 1]])
    plain, ruled = SamplingParams(), SamplingParams(frequency_penalty=1.0, logit_bias=((3, 5.0),))
    rows = [SimpleNamespace(tokens=[8, 4, 1], num_prompt=1, stop_ids=frozenset()),
            SimpleNamespace(tokens=[2], num_prompt=0, stop_ids=frozenset())]
    assert reshape_rows(logits, drafts, rows, [plain, plain]) is logits
    before = logits.clone()
    out = reshape_rows(logits, drafts, rows, [ruled, plain])
    assert torch.equal(logits, before)  # the host's logits are untouched
    assert torch.equal(out[1], logits[1])
    torch.testing.assert_close(out[0], reshape_chain(logits[0], rows[0], [4, 4], ruled))
    assert out[0, 2, 4] == logits[0, 2, 4] - 3.0  # row 2 counts the output's 4 and two drafts


def test_verify_row_is_the_embedded_engines_rule():
    torch.manual_seed(0)
    logits = torch.randn(B, 96)
    draft = logits.argmax(-1)[:2].tolist() + [5]  # the target agrees with 2 drafts
    params = to_sampling_params(SGLangParams(temperature=0.0), 96)
    assert verify_row(draft, None, logits, params, None) == greedy_accept(
        torch.tensor(draft), logits
    )
    # sampling with a stand-in draft (q = point mass) still yields a valid outcome
    sparams = to_sampling_params(SGLangParams(temperature=1.0, sampling_seed=1), 96)
    n, tok = verify_row(draft, None, logits, sparams, torch.Generator().manual_seed(1))
    assert 0 <= n <= len(draft) and 0 <= tok < 96
