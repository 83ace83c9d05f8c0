"""SGLang's sampling parameters mapped onto ours, the requests D3D cannot verify exactly, and each
request's random streams. The accept decision itself is speculative/verify.py's (`verify_batch` for a
whole cycle in the worker; `verify_row` is its one-request form).
"""

from __future__ import annotations

import zlib

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.sampling import (
    RequestRandom,
    Role,
    make_generator,
)
from sglang_d3d.speculative.verify import verify_draft as verify_row  # noqa: F401 - re-exported


def to_sampling_params(sp, vocab_size: int) -> SamplingParams:
    """SGLang SamplingParams -> ours. SGLang marks greedy as top_k == 1 (temperature 0 is
    rewritten to top_k = 1), and "no top-k" as a huge top_k."""
    rules = logit_rules(sp)
    if sp.top_k == 1:
        return SamplingParams(temperature=0.0, max_new_tokens=max(1, sp.max_new_tokens or 1), **rules)
    top_k = sp.top_k if 0 < sp.top_k < vocab_size else 0
    return SamplingParams(
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=int(top_k),
        seed=sp.sampling_seed,
        max_new_tokens=max(1, sp.max_new_tokens or 1),
        **rules,
    )


def logit_rules(sp) -> dict:
    """SGLang's min_p, frequency/presence penalties and logit_bias ({"token id": bias}) as
    ours: verification applies them row by row (speculative/penalties.py, sampling.py)."""
    bias = getattr(sp, "logit_bias", None) or {}
    return dict(
        min_p=float(getattr(sp, "min_p", 0.0) or 0.0),
        frequency_penalty=float(sp.frequency_penalty or 0.0),
        presence_penalty=float(sp.presence_penalty or 0.0),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in bias.items())),
    )


def unsupported_reason(req) -> str | None:
    """Why D3D cannot verify this request exactly, or None. Verification reproduces the target's
    distribution under temperature/top-k/top-p/min-p, frequency/presence penalties and logit_bias;
    anything else that reshapes the logits per step would make the accepted tokens differ from
    what SGLang's sampler would produce."""
    sp = req.sampling_params
    checks = [
        (sp.repetition_penalty != 1, "repetition_penalty"),
        (sp.min_new_tokens > 0, "min_new_tokens"),
        (any((sp.json_schema, sp.regex, sp.ebnf, sp.structural_tag)), "structured output"),
        (sp.beam_width not in (None, 1), "beam search"),
        (getattr(req, "custom_logit_processor", None) is not None, "custom logit processors"),
        (bool(getattr(req, "return_logprob", False)), "logprobs"),
    ]
    names = [name for bad, name in checks if bad]
    if not names:
        return None
    return f"--speculative-algorithm D3D does not support {', '.join(names)} (request {req.rid})"


def request_generator(rid: str, seed: int | None, role: Role) -> RequestRandom:
    """Seeded from the request's seed, else from its id, and from the role (speculative/
    sampling.py `Role`: drafting and verification never share a stream). Deterministic, so
    every run of a seeded request draws alike."""
    return make_generator(seed if seed is not None else zlib.crc32(rid.encode()), role)
