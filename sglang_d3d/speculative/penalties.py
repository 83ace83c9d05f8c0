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

Cost: a rule changes only the logits of tokens the request has touched (its output, the block's
drafts, the biased ids, the prompt for repetition), so the rules run on those columns alone
(`_columns`), and the rest of a row is a plain copy: on this project's CPU, 1 thread, a
16-token row took 10.3 ms over the whole vocabulary and takes 0.53 ms on the columns.

The drafter is not reshaped: any proposal q is exact under rejection sampling, and greedy
acceptance compares drafts with the reshaped argmax. Reshaping the drafter's slots with the
output's counts was tried and measured no gain (GSM8K, sync@8: 2.55 tokens a cycle against
2.53): a penalty mostly costs accepted length in cycles of copies, whose repeated text it
discourages.
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


def path_counts(
    base: torch.Tensor,  # [C] counts before the verify block
    tokens: torch.Tensor,  # [M] long: the block's tokens after its root, as indices into C
    ancestors: torch.Tensor,  # [M+1, M+1] bool: row i's ancestors-or-self, node 0 the root
) -> torch.Tensor:
    """[M+1, C]: the counts each verify row is scored under, the base plus the tokens on the
    row's path from the root (the root's own token is already in the base)."""
    onehot = torch.nn.functional.one_hot(tokens, base.shape[0]).to(base.dtype)  # [M, C]
    on_path = ancestors[:, 1:].to(base.device, base.dtype)  # [M+1, M]
    return base + on_path @ onehot


def chain_ancestors(length: int) -> torch.Tensor:
    """[G+1, G+1] bool: in a chain every earlier position is an ancestor."""
    return torch.ones(length + 1, length + 1, dtype=torch.bool).tril()


def penalize(
    logits: torch.Tensor,  # [T, C] the columns the rules touch (C = V: all of them)
    counts: torch.Tensor,  # [T, C]: the output's counts at each row
    params: SamplingParams,
    in_prompt: torch.Tensor | None = None,  # [C] bool: occurs in the prompt (repetition only)
    bias: torch.Tensor | None = None,  # [C] logit_bias laid out on the columns
) -> torch.Tensor:
    """[T, C] float32: the rule above, applied row by row, on a copy: the caller's logits stay
    raw (log-probabilities are reported from them)."""
    out = logits.to(torch.float32, copy=True)
    if bias is not None:
        out += bias
    if params.repetition_penalty != 1.0:
        seen = counts > 0 if in_prompt is None else (counts > 0) | in_prompt
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    out = out - params.frequency_penalty * counts
    return out - params.presence_penalty * (counts > 0).float()


def bias_vector(params: SamplingParams, cols: torch.Tensor) -> torch.Tensor | None:
    """[C] float32: `params.logit_bias` on the columns `cols` [C] (sorted token ids)."""
    if not params.logit_bias:
        return None
    ids, values = zip(*params.logit_bias)
    out = torch.zeros(cols.shape[0], device=cols.device)
    at = torch.searchsorted(cols, torch.tensor(ids, device=cols.device))
    out[at] = torch.tensor(values, device=cols.device)
    return out


def ban_stops(
    logits: torch.Tensor,  # [T, V] float32, reshaped in place
    positions: torch.Tensor,  # [T] long: the output index of the token each row picks
    params: SamplingParams,
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """The stop tokens of rows that pick a token before `min_tokens` set to -inf."""
    if not (params.min_tokens and stop_ids):
        return logits
    rows = (positions < params.min_tokens).nonzero().squeeze(1)  # [R]
    ids = torch.tensor(sorted(stop_ids), device=logits.device)
    logits[rows.unsqueeze(1), ids] = float("-inf")
    return logits


def reshape_chain(
    logits: torch.Tensor,  # [G+1, V]: row j scores the token after drafts[:j]
    written: Written,
    drafts: Sequence[int],  # [G]
    params: SamplingParams,
) -> torch.Tensor:
    """[G+1, V]: a chain's verify logits under the request's rules (unchanged without any)."""
    if not params.reshapes_logits:
        return logits
    depths = range(len(drafts) + 1)  # row j picks the j-th token after the root
    return _reshape(logits, written, list(drafts), chain_ancestors(len(drafts)), depths, params)


def reshape_tree(
    logits: torch.Tensor,  # [M+1, V]: row i scores the token after node i's path
    written: Written,
    tree: DraftTree,
    params: SamplingParams,
) -> torch.Tensor:
    """[M+1, V]: a token tree's verify logits under the request's rules."""
    if not params.reshapes_logits:
        return logits
    depths = (0, *tree.depths)  # [M+1]: the root picks first
    return _reshape(logits, written, list(tree.tokens), ancestor_mask(tree), depths, params)


def _reshape(logits: torch.Tensor, written: Written, block: list[int], ancestors: torch.Tensor,
             depths: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """The rules on a block's rows [T, V]: penalties and bias on the touched columns, then the
    stop tokens of rows before `min_tokens`."""
    output = written.tokens[written.num_prompt :]
    out = logits.to(torch.float32, copy=True)
    prompt = written.tokens[: written.num_prompt] if params.repetition_penalty != 1.0 else []
    cols = _columns(output, block, prompt, params, logits.device)  # [C]
    if cols.numel():  # none at the first token without bias or repetition: nothing to change
        base = _counts_on(output, cols)  # [C]
        counts = path_counts(base, torch.searchsorted(cols, _ids(block, cols.device)), ancestors)
        in_prompt = torch.isin(cols, _ids(prompt, cols.device)) if prompt else None
        out[:, cols] = penalize(out[:, cols], counts, params, in_prompt, bias_vector(params, cols))
    if params.min_tokens:
        positions = torch.tensor(depths, device=out.device) + len(output)  # [T] output indices
        ban_stops(out, positions, params, written.stop_ids)
    return out


def _columns(output: list[int], block: list[int], prompt: list[int], params: SamplingParams,
             device) -> torch.Tensor:
    """[C] sorted token ids a rule can change: the output, the block, the biased ids, and the
    prompt where repetition_penalty reads it (none where only `min_tokens` is set)."""
    if not (params.frequency_penalty or params.presence_penalty or params.logit_bias
            or params.repetition_penalty != 1.0):
        return torch.empty(0, dtype=torch.long, device=device)
    touched = set(output).union(block, prompt, (t for t, _ in params.logit_bias))
    return torch.tensor(sorted(touched), dtype=torch.long, device=device)


def _counts_on(output: list[int], cols: torch.Tensor) -> torch.Tensor:
    """[C] float32: how often each column's token occurs in the output."""
    at = torch.searchsorted(cols, _ids(output, cols.device))
    return torch.bincount(at, minlength=cols.shape[0]).float()


def _ids(tokens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.long, device=device)


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
    block = drafts.tolist()  # one device -> host copy for all rows
    for i in ruled:
        out[i] = reshape_chain(out[i], written[i], block[i], params[i])
    return out
