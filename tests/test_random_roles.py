"""The embedded engine's random streams, one per role (speculative/sampling.py `Role`).

With the drafter on another device (--draft-device cuda:1), drafting and verification draw from
generators on two devices. Seeded alike, the uniform that picks a draft and the uniform that
tests it are the same number, and sampled output is biased. Here each request's two roles run on
separate generators (as on two devices), through the engine's own draw paths (`draw_drafts`,
`verify_batch`): the first emitted token must follow the target's distribution (chi-square),
and two generators seeded alike, the old seeding on two devices, must fail the same test."""

from __future__ import annotations

import torch

from sglang_d3d.config import SamplingParams
from sglang_d3d.sglang_worker.accept import request_generator
from sglang_d3d.speculative.sampling import (
    Role,
    draw_drafts,
    make_generator,
    role_seed,
    target_probs,
)
from sglang_d3d.speculative.tree import build_tree
from sglang_d3d.speculative.tree_sampling import sample_tree
from sglang_d3d.speculative.verify import verify_batch

N, V = 4000, 5
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)
TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # logits [V]
DRAFTER = torch.tensor([0.0, 1.5, 0.5, 1.0, -0.5])
DOF = V - 1
BOUND = DOF + 5 * (2 * DOF) ** 0.5  # about 18: far in the tail for 4 degrees of freedom


def _first_tokens(draft_gens, verify_gens) -> torch.Tensor:
    """N requests, one draft each, drawn by `draw_drafts` on draft_gens[i] and verified by
    `verify_batch` on verify_gens[i] -> the first emitted token of each [N]."""
    drafted = [draw_drafts(DRAFTER[None], PARAMS, g) for g in draft_gens]  # ([1], q [1, V])
    drafts = torch.tensor([tokens for tokens, _ in drafted])  # [N, 1]
    logits = torch.stack([TARGET, TARGET])[None].expand(N, 2, V)  # [N, G+1, V]
    n, token = verify_batch(drafts, logits, [PARAMS] * N, [q for _, q in drafted], verify_gens)
    return torch.where(n == 1, drafts[:, 0], token)


def _chi2(tokens: torch.Tensor) -> float:
    expected = target_probs(TARGET, PARAMS) * N
    observed = torch.bincount(tokens, minlength=V).float()
    return float(((observed - expected) ** 2 / expected).sum())


def test_a_requests_two_roles_sample_the_target_distribution():
    """One request object, as the engine hands it to drafting and to verification: drafts
    draw on its drafting stream, verification on its own."""
    streams = [make_generator(seed) for seed in range(N)]
    assert _chi2(_first_tokens(streams, streams)) < BOUND


def test_each_side_seeding_its_own_generators_samples_the_target_distribution():
    """Two devices each build their generator from the request's seed alone (nothing shared
    between the sides): the drafting side and the verifying side still draw apart. Before
    streams were seeded per role, this is the old seeding, and it failed."""
    drafting = [make_generator(seed) for seed in range(N)]
    verifying = [make_generator(seed) for seed in range(N)]
    assert _chi2(_first_tokens(drafting, verifying)) < BOUND


def test_one_seed_on_two_devices_is_biased():
    """The control: the old seeding, every device's generator seeded with the request's seed,
    with the drafter on a second device (two torch.Generator objects seeded alike)."""
    seeds = range(N)
    chi2 = _chi2(_first_tokens([torch.Generator().manual_seed(s) for s in seeds],
                               [torch.Generator().manual_seed(s) for s in seeds]))
    assert chi2 > 10 * BOUND


def test_roles_are_seeded_apart_on_every_device_and_reproducibly():
    a, b = make_generator(7), make_generator(7)
    drafting = a.for_role(Role.DRAFTING)
    assert drafting is a.for_role(Role.DRAFTING) and drafting.for_role(Role.VERIFICATION) is a
    assert drafting.on("cpu") is not a.on("cpu")
    assert a.on("cpu").initial_seed() == role_seed(7, Role.VERIFICATION)
    assert drafting.on("cpu").initial_seed() == role_seed(7, Role.DRAFTING)
    assert role_seed(7, Role.DRAFTING) != role_seed(7, Role.VERIFICATION)
    ua = torch.rand(4, generator=drafting.on("cpu"))
    assert torch.equal(ua, torch.rand(4, generator=b.for_role(Role.DRAFTING).on("cpu")))


def test_sampled_trees_draw_on_the_drafting_stream():
    q = torch.softmax(torch.randn(3, 40, generator=torch.Generator().manual_seed(0)), -1)
    chain = q.argmax(-1).tolist()
    shape = build_tree(q, 8)
    a, b = make_generator(11), make_generator(11)
    via_request = sample_tree(shape, chain, q, a)
    via_role = sample_tree(shape, chain, q, b.for_role(Role.DRAFTING))
    assert via_request == via_role
    assert torch.equal(torch.rand(3, generator=a.on("cpu")),  # verification left untouched
                       torch.rand(3, generator=torch.Generator().manual_seed(
                           role_seed(11, Role.VERIFICATION))))


def test_the_sglang_worker_and_the_engine_share_one_seeding():
    for role in Role:
        worker = request_generator("req-1", 42, role).on("cpu")
        engine = make_generator(42).for_role(role).on("cpu")
        assert worker.initial_seed() == engine.initial_seed()
