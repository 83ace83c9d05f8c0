"""The target's projections fused and packed for inference: q/k/v as one GEMM, gate/up as one.

Built beside the HF modules, never in their place: the drafter copies and wraps the target's
projection modules (low-rank deltas), and training needs them as plain `nn.Linear`. Only the
target's inference passes (`Decoder.forward(..., fast=True)`) read these. The weights are
read once at build time; a target whose weights change afterwards must rebuild them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from sglang_d3d.models.cpu_linear import PackedLinear, fuse, probe


@dataclass(frozen=True)
class FusedLayer:
    qkv: PackedLinear  # [H] -> [(Hq + 2 Hkv) * D]
    o: PackedLinear
    gate_up: PackedLinear  # [H] -> [2 I]
    down: PackedLinear
    act: object  # the HF MLP's activation
    input_norm: object  # [..., H] -> [..., H], the HF norms' maths in one kernel
    post_norm: object

    @classmethod
    def from_hf(cls, layer) -> FusedLayer:
        a, m = layer.self_attn, layer.mlp
        kernels = probe()
        return cls(
            qkv=fuse([a.q_proj, a.k_proj, a.v_proj], kernels),
            o=fuse([a.o_proj], kernels),
            gate_up=fuse([m.gate_proj, m.up_proj], kernels),
            down=fuse([m.down_proj], kernels),
            act=m.act_fn,
            input_norm=rms_norm(layer.input_layernorm),
            post_norm=rms_norm(layer.post_attention_layernorm),
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]: down(act(gate x) * up x), as the HF MLP computes it."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


@dataclass(frozen=True)
class FusedModel:
    layers: tuple[FusedLayer, ...]
    norm: object
    lm_head: PackedLinear
    # Decode and verify passes compute each query as if alone (Batch.exact_rows) through
    # this pass: needed where the projections round their inputs (models/exact_pass.py).
    exact: object = None

    @property
    def exact_rows(self) -> bool:
        return self.exact is not None

    @classmethod
    def from_decoder(cls, decoder) -> FusedModel:
        layers = tuple(FusedLayer.from_hf(layer) for layer in decoder.layers)
        return cls(layers, rms_norm(decoder.norm), fuse([decoder.lm_head], probe()))


def rms_norm(module):
    """torch's fused RMSNorm in place of an HF RMSNorm module (7 kernels): bitwise the same
    in fp32 (checked in tests), where HF's own upcast is a no-op. Other dtypes, or a norm
    without the HF attributes, keep the module."""
    w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if w is None or eps is None or w.dtype != torch.float32 or w.device.type != "cpu":
        return module
    return partial(F.rms_norm, normalized_shape=(w.shape[0],), weight=w.detach(), eps=eps)
