"""The 4-bit target's decode and verify passes: every query alone, in one call (the C++ loop of
models/csrc/exact_layers.cpp, or a TorchScript function where it cannot be built).

Why each query alone: where a pass rounds its activations (into the 4-bit kernels,
models/q4_linear.py), the last-bit differences between an attention kernel run over 1 query and
over 16, or over a span padded with masked keys, flip roundings, and 30 layers grow them to
~0.2 in the logits (measured on the default target: a 6-token verify against 6 plain steps),
enough to change greedy tokens between plain decoding and speculation. Here every query is its
own attention over exactly the keys it sees, in cache order, and every other operation works
row by row (the int4 kernel, the norms, RoPE, the MLP; tested), so a token's keys, values and
logits are bitwise the same in a plain step, a chain verify and a token tree.

Why one call: at SmolLM2-135M's size a plain step's 4-bit matrix products take a few ms, and
the ~40 small operations around them per layer cost as much again when Python dispatches each
one. The C++ loop (on the block products) and the scripted one (on torch's int4 kernel) run
them without the interpreter between them.

Precision: each projection rounds its input as its kernel does (models/q4_linear.py: 14-bit
blocks for the block products, bf16 for torch's int4 kernel); the residual stream, norms, RoPE,
attention and MLP activation are fp32. The prompt's prefill takes the general path
(models/decoder.py), on the same projections, shared by every mode.
"""

# ruff: noqa: UP006, UP035, UP045 - TorchScript reads typing's List and Optional
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang_d3d.models.kv_cache import KVCache

GROUP = 32  # the int4 kernel's group: one Q4_1 block


@dataclass(frozen=True)
class KeyPlan:
    """Per query (rows flattened, N * T): the keys it sees, as a count (the first n cache
    entries) or, where counts[i] is -1, cache indices paths[i] [n] long (a token tree's path:
    cache prefix then its ancestors)."""

    counts: list[int]
    paths: list[Tensor]


def key_plan(mask: Tensor) -> KeyPlan:
    """mask [N, T, S] bool (True = may attend) -> the keys each query sees, rows flattened."""
    flat = mask.reshape(-1, mask.shape[-1])  # [N * T, S]
    seen = flat.sum(-1).tolist()  # one read each, not one per query
    lead = flat.int().cumprod(-1).sum(-1).tolist()  # length of the leading run of True
    empty = torch.empty(0, dtype=torch.long)
    counts = [n if n == run else -1 for n, run in zip(seen, lead)]
    paths = [empty if c >= 0 else flat[i].nonzero().squeeze(1) for i, c in enumerate(counts)]
    return KeyPlan(counts, paths)


def chain_plan(lengths: list[int], t: int) -> KeyPlan:
    """The plan key_plan gives a chain of t queries after rows of cached `lengths`: query i
    of a row sees its first length + i + 1 cache entries (built without a mask)."""
    return KeyPlan([n + i + 1 for n in lengths for i in range(t)], [_NO_PATH] * (len(lengths) * t))


_NO_PATH = torch.empty(0, dtype=torch.long)


@dataclass(frozen=True)
class ExactWeights:
    """A 4-bit fused model's layers as flat lists the one-call pass reads: per layer its four
    projections (qkv, o, gate_up, down) as their kernel's operands (`operands[i]`: the i-th
    tensor of every projection; block products: qs, d, m; torch's int4 kernel: packed
    weights, bf16 scales and zeros) and optional fp32 biases, and its two RMSNorm weights."""

    operands: tuple[list[Tensor], ...]
    biases: list[Optional[Tensor]]
    norms: list[Tensor]
    eps: float
    heads: tuple[int, int, int]  # (query heads, key-value heads, head size)
    cpp: bool  # the block products' operands (the C++ loop reads them), else int4's
    final_norm: Tensor  # the RMSNorm weight after the last layer
    final_eps: float

    def keep(self, layers: tuple[int, ...]) -> ExactWeights:
        """The same weights for `layers` only, in that order (a pruned drafter's source layers)."""
        if tuple(layers) == tuple(range(len(self.norms) // 2)):
            return self

        def pick(xs: list, per: int) -> list:
            return [xs[per * i + j] for i in layers for j in range(per)]

        return replace(self, operands=tuple(pick(o, 4) for o in self.operands),
                       biases=pick(self.biases, 4), norms=pick(self.norms, 2))

    @classmethod
    def from_layers(cls, layers, heads: tuple[int, int, int], final_norm) -> ExactWeights:
        """`final_norm`: the model's last RMSNorm (models/fused.rms_norm's fp32 form)."""
        projs, norms, eps = [], [], None
        for layer in layers:
            if "SiLU" not in type(layer.act).__name__:  # torch's or transformers' SiLU
                raise ValueError(f"the 4-bit pass computes SiLU MLPs, not {type(layer.act).__name__}")
            projs += [layer.qkv, layer.o, layer.gate_up, layer.down]
            for norm in (layer.input_norm, layer.post_norm):
                norms.append(norm.keywords["weight"])
                eps = norm.keywords["eps"]
        operands = tuple(list(t) for t in zip(*(p.operands for p in projs)))
        return cls(operands, [p.bias for p in projs], norms, float(eps), heads, projs[0].cpp,
                   final_norm.keywords["weight"], float(final_norm.keywords["eps"]))


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [R, H] -> [R, H]; per row, so a row's result is the same in any pass."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _proj(x: Tensor, packed: Tensor, scales: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [R, K] -> [R, N] bf16 (fp32 with a bias) through the int4 kernel."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32, scales)
    if bias is not None:
        y = y + bias
    return y


def _attend(q: Tensor, kl: Tensor, vl: Tensor, slot: int, count: int, path: Tensor,
            hkv: int) -> Tensor:
    """q [Hq, D] (scaled) over one query's keys in layer cache kl/vl [S, L, Hkv, D] -> [Hq * D]."""
    if count >= 0:
        k, v = kl[slot, :count], vl[slot, :count]  # [n, Hkv, D] views
    else:
        k, v = kl[slot].index_select(0, path), vl[slot].index_select(0, path)
    hq, d = q.shape[0], q.shape[1]
    scores = torch.bmm(q.view(hkv, hq // hkv, d), k.permute(1, 2, 0))  # [Hkv, G, n]
    out = torch.bmm(torch.softmax(scores, -1), v.transpose(0, 1))  # [Hkv, G, D]
    return out.reshape(hq * d)


def _layers(h: Tensor, cos: Tensor, sin: Tensor, slots: List[int], writes: List[int],
            counts: List[int], paths: List[Tensor], packed: List[Tensor], scales: List[Tensor],
            biases: List[Optional[Tensor]], norms: List[Tensor], final_norm: Tensor, kc: Tensor,
            vc: Tensor, eps: float, final_eps: float, hq: int, hkv: int, d: int) -> Tensor:
    """h [R, H] embeddings of R queries -> [R, H] after the final norm. cos, sin [R, 1, D]
    (sin signed, decoder.rope_tables); query r writes cache row slots[r] at writes[r] and sees
    counts[r] / paths[r] (KeyPlan); kc, vc [L, S, max_len, Hkv, D]."""
    r_n = h.shape[0]
    slot_t, write_t = torch.tensor(slots), torch.tensor(writes)
    scale = 1.0 / math.sqrt(d)
    for li in range(kc.shape[0]):
        p = 4 * li
        qkv = _proj(_rms(h, norms[2 * li], eps), packed[p], scales[p], biases[p])
        qk = qkv[:, : (hq + hkv) * d].view(r_n, hq + hkv, d)
        qk = qk * cos + torch.roll(qk, d // 2, -1) * sin  # RoPE on q and k at once, fp32
        q, k = qk[:, :hq] * scale, qk[:, hq:]
        v = qkv[:, (hq + hkv) * d :].view(r_n, hkv, d).float()
        kl, vl = kc[li], vc[li]
        kl.index_put_((slot_t, write_t), k)
        vl.index_put_((slot_t, write_t), v)
        att = [_attend(q[r], kl, vl, slots[r], counts[r], paths[r], hkv) for r in range(r_n)]
        h = h + _proj(torch.stack(att), packed[p + 1], scales[p + 1], biases[p + 1])
        gate_up = _proj(_rms(h, norms[2 * li + 1], eps), packed[p + 2], scales[p + 2], biases[p + 2]).float()
        inter = gate_up.shape[1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        h = h + _proj(act, packed[p + 3], scales[p + 3], biases[p + 3])
    return F.rms_norm(h, [h.shape[-1]], final_norm, final_eps)


def scripted_layers():
    """`_layers` through TorchScript; the Python function itself (the same operations, the
    same results, tested) where this torch cannot script it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # scripting is kept for CPU speed
            return torch.jit.script(_layers)
    except Exception:  # noqa: BLE001 - any scripting failure leaves the eager path
        return _layers


KERNELS = ("auto", "cpp", "script")


def use_cpp(kernels: str) -> bool:
    """Whether a 4-bit model runs on the C++ kernels (the block products and the C++ loop,
    models/csrc/) or on torch's int4 kernel and the TorchScript loop; auto takes C++ where it
    builds with vector block products (AVX2 or better). On their plain C++ loop a 4-bit step
    took 201 ms where fp32 took 48 ms (SmolLM2-135M, 1 thread, an AVX2 CPU before it had its
    own path), so auto leaves a CPU without one to torch's kernel. Each is exact with itself:
    a runner keeps the one it was built with."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {kernels!r}")
    if kernels == "script":
        return False
    from sglang_d3d.models import cpu_kernels

    if cpu_kernels.load() and (kernels == "cpp" or cpu_kernels.vectorised()):
        return True
    if kernels == "cpp":
        raise RuntimeError("the C++ CPU kernels did not build (see the log); use 'auto' or 'script'")
    return False


class ExactPass:
    """The layers of a 4-bit fused model, every query alone, on the loop its weights' kernel
    belongs to."""

    def __init__(self, weights: ExactWeights) -> None:
        self.weights = weights
        self._fn = torch.ops.d3d_cpu.exact_layers if weights.cpp else scripted_layers()

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, slots: list[int],
                 write_at: Tensor, plan: KeyPlan, weights: ExactWeights | None = None,
                 deltas: list[Tensor] | None = None, masked: list[int] | None = None,
                 coarse: bool = False) -> Tensor:
        """h [N, T, H] embeddings; cos, sin [N, 1, T, D]; write_at [N, T] -> [N, T, H] after
        the model's final norm (in the C++ call: each torch call after a step's weights have
        streamed through the caches costs several times its isolated time). A drafter's pass
        (C++ loop only): `weights` its layers (ExactWeights.keep), `deltas` per layer the a and
        b of its 4 projections' deltas (8 a layer), `masked` [N * T] 1 at its mask slots, where
        the deltas apply, and `coarse` its projections' inputs rounded to 8 bits, not 14
        (models/csrc/block_mm.cpp): for passes whose outputs only propose, never for a pass
        whose rows must equal a plain step's or that writes the target's cache."""
        n, t, width = h.shape
        w = weights or self.weights
        rows = [s for s in slots for _ in range(t)]
        cos_r = cos.squeeze(1).reshape(n * t, 1, -1).contiguous()  # [N * T, 1, D]
        sin_r = sin.squeeze(1).reshape(n * t, 1, -1).contiguous()
        args = (h.reshape(n * t, width), cos_r, sin_r, rows, write_at.reshape(-1).tolist(),
                plan.counts, plan.paths, *w.operands, w.biases, w.norms, w.final_norm,
                cache.k, cache.v, w.eps, w.final_eps, *w.heads)
        if deltas is not None and not w.cpp:
            raise ValueError("a drafter's pass with deltas runs on the C++ layer loop only")
        if w.cpp:
            args += (deltas or [], masked or [], coarse)
        elif coarse:
            raise ValueError("coarse inputs run on the C++ layer loop only")
        return self._fn(*args).view(n, t, width)
