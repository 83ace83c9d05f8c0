"""The target's log-probabilities of emitted tokens, from the logits verification already has.

Reported log-probabilities are those of the target's raw distribution, log_softmax(logits),
before temperature, top-k and top-p (what OpenAI and vLLM's default report). They therefore do
not depend on the sampling parameters, nor on whether a token came from a draft the target
accepted or from the target's own pick: in both cases row j of the verify logits scores the
token emitted at position j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its log-probability and the k likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


def token_logprobs(
    logits: torch.Tensor,  # [T, V]: row j scores the token emitted at position j
    tokens: list[int],  # [T] the emitted tokens
    k: int,  # alternatives per position, 0..MAX_TOP_LOGPROBS
) -> list[TokenLogprob]:
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"k must be in [0, {MAX_TOP_LOGPROBS}]")
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(tokens)} tokens")
    if not tokens:
        return []
    # float64 logits (tests) stay float64; half precision is lifted so the softmax is accurate.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)  # [T, V]
    ids = torch.tensor(tokens, device=logits.device).unsqueeze(1)  # [T, 1]
    chosen = logp.gather(1, ids).squeeze(1).tolist()  # [T]
    top_ids: list[list[int]] = [[] for _ in tokens]
    top_lp: list[list[float]] = [[] for _ in tokens]
    if k > 0:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [T, k] each
        top_ids, top_lp = indices.tolist(), values.tolist()
    return [
        TokenLogprob(tok, lp, tuple(zip(ti, tl)))
        for tok, lp, ti, tl in zip(tokens, chosen, top_ids, top_lp)
    ]
