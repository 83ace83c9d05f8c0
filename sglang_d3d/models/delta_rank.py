"""Cut a drafter's low-rank deltas to a lower rank after training (`d3d compact --rank`).

Every shipped checkpoint stays in the repository's history, so a drafter's size is paid for
good (docs/drafter.md, "Choosing the drafter to ship"). A delta `scale * B @ A` of rank r cut
to rank k keeps the k largest singular directions of the product: by Eckart-Young the closest
rank-k matrix to it in Frobenius norm, so no retraining is needed to try a smaller checkpoint,
only a measurement of what it costs in accepted length (benchmarks/results/README.md).

The singular values are split evenly between the new B and A (sqrt on each side), so that
both keep comparable magnitudes for the quantised stores' group scales.
"""

from __future__ import annotations

import re

import torch

DELTA_A = re.compile(r"^(delta\..+)\.a$")


def singular_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [r, in], b [out, r] -> the singular values [r] of b @ a, largest first."""
    _, _, (_, s, _) = _core(a, b)
    return s


def truncate(
    a: torch.Tensor,  # [r, in]
    b: torch.Tensor,  # [out, r]
    k: int,
    scale: float = 1.0,
    new_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (a2 [k, in], b2 [out, k]) with new_scale * b2 @ a2 the closest rank-k matrix to
    scale * b @ a. In a and b's dtype; computed in float64."""
    return _cut(_core(a, b), k, scale / new_scale, a.dtype)


def _cut(core, k: int, factor: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a2 [k, in], b2 [out, k]) from `_core`'s parts, the product scaled by `factor`."""
    qa, qb, (u, s, vh) = core
    if not 1 <= k <= s.shape[0]:
        raise ValueError(f"rank {k}: must be 1 to the deltas' rank {s.shape[0]}")
    root = (s[:k] * factor).sqrt()  # [k]
    b2 = (qb @ u[:, :k]) * root  # [out, k]
    a2 = root.unsqueeze(1) * (vh[:k] @ qa.T)  # [k, in]
    return a2.to(dtype), b2.to(dtype)


def _core(a: torch.Tensor, b: torch.Tensor):
    """b @ a = qb @ (rb @ ra.T) @ qa.T with qa, qb orthonormal: the SVD of the small [r, r]
    core is the product's, without forming the [out, in] matrix. -> (qa [in, r], qb [out, r],
    (u, s, vh) of the core), in float64."""
    qa, ra = torch.linalg.qr(a.double().T)  # [in, r], [r, r]
    qb, rb = torch.linalg.qr(b.double())  # [out, r], [r, r]
    return qa, qb, torch.linalg.svd(rb @ ra.T)


def truncate_state(
    state: dict[str, torch.Tensor], rank: int, alpha: float, k: int
) -> tuple[dict[str, torch.Tensor], float]:
    """A drafter's own state with every delta cut from `rank` to `k` (the deltas' scale is
    alpha / rank, so it changes with the rank: folded in). -> (new state, the share of the
    deltas' squared singular values kept, over all of them)."""
    out, kept, total = dict(state), 0.0, 0.0
    for name in state:
        m = DELTA_A.match(name)
        if m is None:
            continue
        a, b = state[name], state[f"{m.group(1)}.b"]
        core = _core(a, b)  # once per delta: its singular values and the cut share it
        s2 = core[2][1].square()
        kept, total = kept + float(s2[:k].sum()), total + float(s2.sum())
        out[name], out[f"{m.group(1)}.b"] = _cut(core, k, k / rank, a.dtype)
    return out, (kept / total if total > 0 else 1.0)
