"""Each SGLang request's random streams, one per role (sglang_worker/accept.py `Role`).

With the drafter on a second GPU, drafting and verification draw from two generators. Seeded
alike, the uniform that picks a draft and the uniform that tests it are the same number, and
sampled output is biased. Here the two roles run on separate generators (as on two devices);
the first token sampled through draft -> rejection sampling must follow the target's
distribution (chi-square), and the same test with one seed for both roles must fail it."""

from __future__ import annotations

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.sglang_worker.accept import Role, request_generator
from sglang_d3d.speculative.sampling import make_generator, sample_rows, target_probs
from sglang_d3d.speculative.verify import verify_batch

N, V = 4000, 5
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)
TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # logits [V]
DRAFTER = torch.tensor([0.0, 1.5, 0.5, 1.0, -0.5])


def _first_tokens(draft_gens, verify_gens) -> torch.Tensor:
    """N requests, one draft each: drawn from q on its drafting stream, verified against p on
    its verification stream. -> the first emitted token of each [N]."""
    q = torch.softmax(DRAFTER, -1)
    drafts = torch.tensor([sample_rows(q[None], g) for g in draft_gens])  # [N, 1]
    logits = torch.stack([TARGET, TARGET])[None].expand(N, 2, V)  # [N, G+1, V]
    proposals = [q[None]] * N  # [G, V] each
    n, token = verify_batch(drafts, logits, [PARAMS] * N, proposals, verify_gens)
    return torch.where(n == 1, drafts[:, 0], token)


def _chi2(tokens: torch.Tensor) -> float:
    expected = target_probs(TARGET, PARAMS) * N
    observed = torch.bincount(tokens, minlength=V).float()
    return float(((observed - expected) ** 2 / expected).sum())


DOF = V - 1
BOUND = DOF + 5 * (2 * DOF) ** 0.5  # about 18: far in the tail for 4 degrees of freedom


def test_role_streams_on_separate_generators_sample_the_target_distribution():
    rids = [f"req-{i}" for i in range(N)]
    drafting = [request_generator(r, None, Role.DRAFTING) for r in rids]
    verifying = [request_generator(r, None, Role.VERIFICATION) for r in rids]
    assert _chi2(_first_tokens(drafting, verifying)) < BOUND


def test_one_seed_for_both_roles_is_biased():
    """The control: two generators seeded alike (one per device, the old seeding) fail the same
    test, so the test above can tell."""
    seeds = range(N)
    chi2 = _chi2(_first_tokens([make_generator(s) for s in seeds],
                               [make_generator(s) for s in seeds]))
    assert chi2 > 10 * BOUND


def test_role_streams_are_reproducible_and_distinct():
    a = request_generator("r", 7, Role.DRAFTING).on("cpu")
    b = request_generator("r", 7, Role.DRAFTING).on("cpu")
    c = request_generator("r", 7, Role.VERIFICATION).on("cpu")
    ua, ub, uc = (torch.rand(4, generator=g) for g in (a, b, c))
    assert torch.equal(ua, ub) and not torch.equal(ua, uc)
