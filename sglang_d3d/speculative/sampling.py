"""Logits -> probabilities under a request's sampling parameters, and seeded draws.

The processed distribution is what speculative verification must reproduce exactly, so the
target's logits always go through `target_probs` (temperature, top-k, top-p, min-p, in that
order; SGLang's sampler keeps the same order).
"""

from __future__ import annotations

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
    Drafts must be drawn from the q that verification is given, or sampling is not exact."""
    q = draft_probs(logits, params)
    if params.greedy:
        return logits.argmax(-1).tolist(), q
    return sample_rows(q, generator), q  # on q's device, one host sync


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


class RequestRandom:
    """A request's random streams: one torch.Generator per device, all seeded from the
    request's seed. CUDA sampling needs a generator on the probabilities' device (a CPU
    generator handed to torch.multinomial on CUDA tensors raises), and the drafter and the
    target may sit on different devices. Same seed, same draws per device, so seeded requests
    are reproducible and tensor-parallel ranks agree."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device | str) -> torch.Generator:
        device = _concrete(torch.device(device))
        g = self._by_device.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._by_device[device] = g
        return g


def on_device(
    generator: RequestRandom | torch.Generator | None, device: torch.device | str
) -> torch.Generator | None:
    """The generator to pass to a torch op on `device`. A bare torch.Generator is used as given
    (the caller chose its device)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return generator.on(device)


def make_generator(seed: int | None) -> RequestRandom:
    """A request's random streams; an unseeded request gets a fresh random seed."""
    return RequestRandom(torch.Generator().seed() if seed is None else seed)


def _concrete(device: torch.device) -> torch.device:
    """A bare "cuda" means the current CUDA device: one device, one generator."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
