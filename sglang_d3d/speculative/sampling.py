"""Logits -> probabilities under a request's sampling parameters, and seeded draws.

The processed distribution is what speculative verification must reproduce exactly, so the
target's logits always go through `target_probs` (temperature, top-k, top-p, min-p, in that
order; SGLang's sampler keeps the same order).

Each request draws from two streams, one per `Role`: the drafter's draws, and the draws from the
target (first tokens, verification), so the two never replay each other's uniforms.
"""

from __future__ import annotations

import enum
import zlib

import torch

from sglang_d3d.config import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32). Greedy is a one-hot on the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    if params.min_p > 0:
        logits = _min_p_filter(logits, params.min_p)
    return torch.softmax(logits, dim=-1)


def _min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the likeliest one's: in logits,
    below the top logit + log(min_p) (a ratio of probabilities, so renormalising after top-k
    or top-p does not move it, and the top token always stays)."""
    floor = logits.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p))
    return logits.masked_fill(logits < floor, float("-inf"))


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (the top one always)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token
    drop_sorted = before >= top_p
    drop_sorted[..., 0] = False  # even a top_p that rounds to 0 keeps the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The drafter's proposal distribution q [..., V]. Any q is exact under rejection sampling;
    matching the target's temperature keeps acceptance high."""
    temperature = params.temperature if not params.greedy else 1.0
    return torch.softmax(logits.float() / temperature, dim=-1)


def usable(logits: torch.Tensor) -> bool:
    """logits [..., V]: every row has a finite logit to draw from (a drafter fault if not)."""
    return bool(torch.isfinite(logits).any(-1).all())


def draw_drafts(logits: torch.Tensor, params: SamplingParams,
                generator: RequestRandom | torch.Generator | None) -> tuple[list[int], torch.Tensor]:
    """Drafter slot logits [B, V] -> (one draft per slot: argmax, or drawn from q; q [B, V]).
    Drafts must be drawn from the q that verification is given, or sampling is not exact.
    A request's streams draw here in their drafting role (`Role`)."""
    q = draft_probs(logits, params)
    if params.greedy:
        return logits.argmax(-1).tolist(), q
    return sample_rows(q, as_role(generator, Role.DRAFTING)), q  # on q's device, one host sync


def sample_rows(probs: torch.Tensor, generator: RequestRandom | torch.Generator | None) -> list[int]:
    """One draw per row of probs [R, V], with one host sync for all rows, by inverse CDF as
    verification draws (verify.py): first tokens, drafts, and through the engine's `ar` mode,
    training data (training/generation.py). Measured on this CPU, 4 rows of 49152
    (benchmarks/bench_sampling_ops.py): 0.55 ms against torch.multinomial's 4.2 ms, in every
    sampled drafter cycle."""
    u = torch.rand(probs.shape[0], generator=on_device(generator, probs.device), device=probs.device)
    return inverse_cdf(probs, u).tolist()


def inverse_cdf(
    probs: torch.Tensor,  # [N, V], rows sum to ~1
    u: torch.Tensor,  # [N] uniforms in [0, 1)
) -> torch.Tensor:
    """One draw per row [N] by inverting each row's cumulative distribution at u: one batched op
    instead of a sampler call per row. Sums in float64 keep round-off far below any probability
    that matters (a float32 cumsum over 152k entries drifts by ~1e-5), and a token of
    probability zero is never returned: its cdf equals its predecessor's, so it is never the
    first entry above the threshold, and the clamp keeps float edge cases on the last token
    with mass."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    threshold = (u.double() * cdf[:, -1]).unsqueeze(1)  # [N, 1]
    first_above = torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # [N]
    v = probs.shape[-1]
    last_with_mass = v - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [N]
    return torch.minimum(first_above, last_with_mass)


def sample(probs: torch.Tensor, generator: RequestRandom | torch.Generator | None) -> int:
    """One draw from probs [V]: `sample_rows` on one row (the same draw, the same stream)."""
    return sample_rows(probs.unsqueeze(0), generator)[0]


class Role(enum.Enum):
    """What a request's random stream is for. Each role has a stream of its own."""

    DRAFTING = "drafting"  # the drafter's draws (sampled drafts, tree branches)
    VERIFICATION = "verification"  # draws from the target: first tokens, rejection sampling


def role_seed(seed: int, role: Role) -> int:
    """The seed of one role's stream, derived from the request's seed (deterministic, so every
    run of a seeded request draws alike, and distinct per role)."""
    return zlib.crc32(f"{role.value}:{seed}".encode())


class RequestRandom:
    """One role's random streams for a request: one torch.Generator per device, seeded from
    the request's seed and the role. CUDA sampling needs a generator on the probabilities'
    device, and the drafter and the target may sit on different devices. Seeded per role, not
    per device: with the drafter on a second GPU, one seed everywhere would make the uniforms
    that pick the drafts and the uniforms that test them identical Philox streams advancing
    about in step, and sampled output would be biased (tests/test_random_roles.py). Not per
    device: tensor-parallel ranks, each on its own GPU, must draw alike; and each role draws on
    one device only (the drafter's or the target's). Seeded requests stay reproducible.
    `for_role` gives the same request's stream of another role."""

    def __init__(self, seed: int, role: Role = Role.VERIFICATION) -> None:
        self.request_seed = seed  # shared by the request's roles
        self.role = role
        self.seed = role_seed(seed, role)  # what this role's generators are seeded with
        self._by_device: dict[torch.device, torch.Generator] = {}
        self._roles: dict[Role, RequestRandom] = {role: self}

    def on(self, device: torch.device | str) -> torch.Generator:
        device = _concrete(torch.device(device))
        g = self._by_device.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._by_device[device] = g
        return g

    def for_role(self, role: Role) -> RequestRandom:
        """The same request's stream for `role`, created once and shared by its roles."""
        other = self._roles.get(role)
        if other is None:
            other = RequestRandom(self.request_seed, role)
            other._roles = self._roles
            self._roles[role] = other
        return other


def as_role(generator: RequestRandom | torch.Generator | None,
            role: Role) -> RequestRandom | torch.Generator | None:
    """A request's stream for `role`; a bare torch.Generator (or None) is used as given."""
    return generator.for_role(role) if isinstance(generator, RequestRandom) else generator


def on_device(
    generator: RequestRandom | torch.Generator | None, device: torch.device | str
) -> torch.Generator | None:
    """The generator to pass to a torch op on `device`. A bare torch.Generator is used as given
    (the caller chose its device)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return generator.on(device)


def make_generator(seed: int | None, role: Role = Role.VERIFICATION) -> RequestRandom:
    """A request's stream for `role` (its other roles through `for_role`); an unseeded request
    gets a fresh random seed."""
    return RequestRandom(torch.Generator().seed() if seed is None else seed, role)


def _concrete(device: torch.device) -> torch.device:
    """A bare "cuda" means the current CUDA device: one device, one generator."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
