"""Speed of a drafter: one branch-batch pass (micro), and end-to-end async decoding (macro)."""

from __future__ import annotations

import statistics
import time

import torch

from sglang_d3d.models.draft_runner import DraftRunner
from sglang_d3d.models.packing import branch_pack, extend_pack


@torch.inference_mode()
def branch_batch_seconds(
    drafter, block: int, budget: int, prefix_len: int = 256, repeats: int = 10, seed: int = 0
) -> float:
    """Median seconds of one asynchronous pre-drafting pass: the B-1 drafts under
    verification plus `budget` branches of (guessed token + B-1 mask slots), over a cached
    prefix of `prefix_len` tokens, as the engine issues it while the target verifies."""
    gen = torch.Generator().manual_seed(seed)
    vocab = drafter.arch.vocab_size
    runner = DraftRunner(drafter, 1, prefix_len + block + budget * block + 8)
    runner.run([(0, extend_pack(torch.randint(0, vocab, (prefix_len,), generator=gen).tolist(), 0))])
    drafts = torch.randint(0, vocab, (block - 1,), generator=gen).tolist()
    branches = [(min(i, block - 1), int(t)) for i, t in
                enumerate(torch.randint(0, vocab, (budget,), generator=gen))]
    pack = branch_pack(drafts, branches, block)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        runner.run([(0, pack)])  # branch packs commit nothing: the cache length is unchanged
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up allocators


def tokens_per_second(target, drafter, prompts: list[list[int]], block: int,
                      max_new_tokens: int = 64, mode: str = "async") -> dict:
    """Greedy batch-1 decoding of `prompts` one at a time in the engine's `mode` (ar, sync or
    async; ar ignores the drafter)."""
    from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
    from sglang_d3d.engine.engine import SpecEngine
    from sglang_d3d.engine.offline import generate

    m = Mode(mode)
    cfg = EngineConfig(mode=m, spec=SpecConfig(block_size=block), max_batch_size=1)
    engine = SpecEngine(cfg, target, None if m is Mode.AR else drafter)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(2,))
    tokens, seconds, lengths = 0, 0.0, []
    for p in prompts:
        t0 = time.perf_counter()
        out = generate(engine, [p], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        if out.stats is not None:
            lengths += out.stats.accepted_lengths
    return {"tokens_per_s": tokens / seconds if seconds else float("nan"),
            "engine_accept_len": statistics.mean(lengths) if lengths else float("nan"),
            "tokens": tokens}
