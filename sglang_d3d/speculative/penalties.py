"""Logit rules that depend on what a request has written so far: OpenAI's `frequency_penalty`,
`presence_penalty` and `logit_bias`, and vLLM's `repetition_penalty`.

In vLLM's order: the bias is added; then a token that occurs in the prompt or the output has
its logit divided by `repetition_penalty` where positive, multiplied where negative; then, for
a token written c[t] times in the output so far (the prompt does not count for these two),

    l[t] - frequency_penalty * c[t] - presence_penalty * (c[t] > 0)

and temperature, top-k, top-p and min-p then apply as usual (sampling.py). The bias and the two
additive penalties commute, so the order matters only with `repetition_penalty`. Last,
vLLM's `min_tokens`: while the output is shorter than it, the request's stop tokens (its
end-of-sequence tokens and stop_token_ids) are banned.

Why verification stays exact: the rule at a position depends on the tokens before it, and a
verify pass scores several positions at once. Row j of a chain's verify logits scores the token
after drafts d_1..d_j, so it is reshaped with the output's counts plus d_1..d_j, exactly the
counts plain decoding would have there if those drafts were accepted; a tree node's row adds
the tokens on its own path (`path_counts`). Rows past a rejection are never used.

The drafter is not reshaped: any proposal q is exact under rejection sampling, and greedy
acceptance compares drafts with the reshaped argmax. Reshaping the drafter's slots with the
output's counts was tried and measured no gain (benchmarks/results/README.md, sitting 28): a
penalty mostly costs accepted length in cycles of copies, whose repeated text it discourages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.tree import DraftTree, ancestor_mask


class Written(Protocol):
    """A request's tokens as its host keeps them (the engine's `Sequence`, the SGLang
    worker's `RequestRow`): sliced only when a rule needs them."""

    tokens: list[int]  # prompt + output so far, the verify block's root included
    num_prompt: int
    stop_ids: frozenset[int]  # the tokens that end it (what `min_tokens` bans)


def output_counts(output: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[V] float32: how often each token occurs in the output so far."""
    ids = torch.tensor(list(output), dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab).float()


def path_counts(
    base: torch.Tensor,  # [V] counts before the verify block
    tokens: torch.Tensor,  # [M] long: the block's tokens after its root (drafts or tree nodes)
    ancestors: torch.Tensor,  # [M+1, M+1] bool: row i's ancestors-or-self, node 0 the root
) -> torch.Tensor:
    """[M+1, V]: the counts each verify row is scored under, the base plus the tokens on the
    row's path from the root (the root's own token is already in the base)."""
    onehot = torch.nn.functional.one_hot(tokens, base.shape[0]).to(base.dtype)  # [M, V]
    on_path = ancestors[:, 1:].to(base.device, base.dtype)  # [M+1, M]
    return base + on_path @ onehot


def chain_ancestors(length: int) -> torch.Tensor:
    """[G+1, G+1] bool: in a chain every earlier position is an ancestor."""
    return torch.ones(length + 1, length + 1, dtype=torch.bool).tril()


def penalize(
    logits: torch.Tensor,  # [T, V]
    counts: torch.Tensor,  # [T, V]: the output's counts at each row
    params: SamplingParams,
    in_prompt: torch.Tensor | None = None,  # [V] bool: occurs in the prompt (repetition only)
) -> torch.Tensor:
    """[T, V] float32: the rule above, applied row by row, on a copy: the caller's logits stay
    raw (log-probabilities are reported from them)."""
    out = logits.to(torch.float32, copy=True)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[:, list(ids)] += torch.tensor(bias, dtype=out.dtype, device=out.device)
    if params.repetition_penalty != 1.0:
        seen = counts > 0 if in_prompt is None else (counts > 0) | in_prompt
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    out = out - params.frequency_penalty * counts
    return out - params.presence_penalty * (counts > 0).float()


def ban_stops(
    logits: torch.Tensor,  # [T, V] float32, reshaped in place
    positions: torch.Tensor,  # [T] long: the output index of the token each row picks
    params: SamplingParams,
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """The stop tokens of rows that pick a token before `min_tokens` set to -inf."""
    early = positions < params.min_tokens  # [T]
    if params.min_tokens and stop_ids and bool(early.any()):
        ids = torch.tensor(sorted(stop_ids), device=logits.device)
        rows = early.nonzero().squeeze(1)
        logits[rows.unsqueeze(1), ids] = float("-inf")
    return logits


def _rule_inputs(written: Written, params: SamplingParams, vocab: int,
                 device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the output's counts [V], which tokens occur in the prompt [V] bool, or None where no
    rule reads the prompt)."""
    base = output_counts(written.tokens[written.num_prompt :], vocab, device)
    if params.repetition_penalty == 1.0:
        return base, None
    return base, output_counts(written.tokens[: written.num_prompt], vocab, device) > 0


def reshape_chain(
    logits: torch.Tensor,  # [G+1, V]: row j scores the token after drafts[:j]
    written: Written,
    drafts: Sequence[int],  # [G]
    params: SamplingParams,
) -> torch.Tensor:
    """[G+1, V]: a chain's verify logits under the request's rules (unchanged without any)."""
    if not params.reshapes_logits:
        return logits
    base, in_prompt = _rule_inputs(written, params, logits.shape[-1], logits.device)
    tokens = torch.tensor(list(drafts), dtype=torch.long, device=logits.device)
    counts = path_counts(base, tokens, chain_ancestors(len(drafts)))
    depths = torch.arange(len(drafts) + 1, device=logits.device)  # [G+1]
    return _finish_rules(penalize(logits, counts, params, in_prompt), written, depths, params)


def reshape_tree(
    logits: torch.Tensor,  # [M+1, V]: row i scores the token after node i's path
    written: Written,
    tree: DraftTree,
    params: SamplingParams,
) -> torch.Tensor:
    """[M+1, V]: a token tree's verify logits under the request's rules."""
    if not params.reshapes_logits:
        return logits
    base, in_prompt = _rule_inputs(written, params, logits.shape[-1], logits.device)
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=logits.device)
    ruled = penalize(logits, path_counts(base, tokens, ancestor_mask(tree)), params, in_prompt)
    depths = torch.tensor((0, *tree.depths), device=logits.device)  # [M+1]: the root picks first
    return _finish_rules(ruled, written, depths, params)


def _finish_rules(ruled: torch.Tensor, written: Written, depths: torch.Tensor,
                  params: SamplingParams) -> torch.Tensor:
    """`ban_stops` with each row's output index: the output's length plus the row's depth."""
    positions = depths + (len(written.tokens) - written.num_prompt)
    return ban_stops(ruled, positions, params, written.stop_ids)


def reshape_rows(
    logits: torch.Tensor,  # [N, G+1, V] a verify pass of chains
    drafts: torch.Tensor,  # [N, G] long
    written: Sequence[Written],  # [N]
    params: Sequence[SamplingParams],  # [N]
) -> torch.Tensor:
    """[N, G+1, V]: `reshape_chain` on every row that has rules. Without any, the logits
    themselves; with some, a float32 copy (the host's logits stay as they were; argmax and
    probabilities are unchanged by the cast from half precision)."""
    ruled = [i for i, sp in enumerate(params) if sp.reshapes_logits]
    if not ruled:
        return logits
    out = logits.to(torch.float32, copy=True)
    for i in ruled:
        out[i] = reshape_chain(out[i], written[i], drafts[i].tolist(), params[i])
    return out
