"""SGLang's target layout and KV pool stood in by plain tensors, so that the shared drafter
(pool_draft.py) runs its contract without sglang: in tests on CPU, and on a GPU machine that
has no sglang (benchmarks/gpu_pool_draft.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


def sglang_like(hf) -> nn.Module:
    """The HF model's weights in SGLang's layout: fused qkv_proj and gate_up_proj (copies made
    once, as SGLang's loader makes them; the drafter must then share these)."""
    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().clone()
        attn = nn.Module()
        attn.qkv_proj = nn.Linear(1, 1, bias=False)
        attn.qkv_proj.weight = nn.Parameter(qkv, requires_grad=False)
        if a.q_proj.bias is not None:
            attn.qkv_proj.bias = nn.Parameter(torch.cat([a.q_proj.bias, a.k_proj.bias,
                                                         a.v_proj.bias]).detach().clone())
        attn.o_proj = nn.Linear(1, 1, bias=False)
        attn.o_proj.weight = nn.Parameter(a.o_proj.weight.detach().clone())
        for name in ("q_norm", "k_norm"):  # Qwen3
            if hasattr(a, name):
                norm = nn.Module()
                norm.weight = nn.Parameter(getattr(a, name).weight.detach().clone())
                setattr(attn, name, norm)
        mlp = nn.Module()
        for name, w in (("gate_up_proj", torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                        ("down_proj", m.down_proj.weight)):
            setattr(mlp, name, nn.Linear(1, 1, bias=False))
            getattr(mlp, name).weight = nn.Parameter(w.detach().clone())
        out = nn.Module()
        out.self_attn, out.mlp = attn, mlp
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = nn.Module()
            norm.weight = nn.Parameter(getattr(layer, name).weight.detach().clone())
            setattr(out, name, norm)
        layers.append(out)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(layers)
    model.model.norm = nn.Module()
    model.model.norm.weight = nn.Parameter(hf.model.norm.weight.detach().clone())
    model.model.embed_tokens = nn.Embedding.from_pretrained(hf.model.embed_tokens.weight.clone())
    model.lm_head = SimpleNamespace(weight=hf.lm_head.weight.detach().clone())
    return model


class FakePool:
    """SGLang's token-to-KV pool: per layer, K and V buffers [slots, Hkv, D]."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]
