"""Build the D3D drafter next to a target that SGLang has already loaded.

`D3DDrafter.from_pretrained` wants our `Decoder` over an HF model: the drafter runs the target's
own layers at its `source_layers` (its checkpoint holds only low-rank deltas and the mask
embedding). SGLang's loaded modules are its own fused, possibly sharded or quantised layers, so
the HF model is built on the meta device and only the drafter's source layers and the final norm
are materialised, read from the target's safetensors (a second copy of those layers: the cost of
an independent drafter inside SGLang). The embedding and head are SGLang's own tensors where they
can be shared (same device, tensor parallel size 1), else read from the safetensors too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sglang_d3d.models.architectures import check_architecture
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter, fingerprint

EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # not fp8 or packed integers


def build_drafter(
    drafter_path: str | Path,
    target_path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    embed: torch.Tensor | None = None,  # [V, H] the target's embedding, if it can be shared
    head: torch.Tensor | None = None,  # [V, H] the target's LM head, if it can be shared
) -> D3DDrafter:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(str(target_path))
    check_architecture(hf_cfg)  # before building it: another family's layers may not fit
    check_unquantised(hf_cfg, target_path)
    source_layers = json.loads((Path(drafter_path) / "config.json").read_text())["source_layers"]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    for i in source_layers:
        hf.model.layers[i].to_empty(device=device)
    hf.model.norm.to_empty(device=device)
    wanted = tuple(f"model.layers.{i}." for i in source_layers) + ("model.norm.",)
    _copy_into(hf, read_tensors(target_path, lambda k: k.startswith(wanted)), wanted)
    # From the files: SGLang's shared tensors may not hold their weights yet at this point.
    file_embed = read_tensors(target_path, lambda k: k == EMBED_KEY)[EMBED_KEY]
    target_print = fingerprint(hf_cfg.model_type, hf_cfg.num_hidden_layers, file_embed,
                               hf.model.norm.weight)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg).to(device)
    if embed is None or head is None:
        embed, head = read_embed_and_head(target_path, hf_cfg)
    hf.model.embed_tokens = _frozen_embedding(embed.to(device, dtype))
    hf.lm_head = _frozen_head(head.to(device, dtype))
    drafter = D3DDrafter.from_pretrained(Path(drafter_path), Decoder.from_hf(hf), target_print)
    return drafter.eval()


def mark_for_sglang(drafter_dir: str | Path, target_dir: str | Path) -> None:
    """Add the target's `model_type` to a drafter's config.json. SGLang 0.5.23 parses the
    --speculative-draft-model-path config as a Hugging Face config in several places (algorithm
    aliases, boundary-reduction defaults) before any plugin code runs; with a model_type it
    parses (as a config of the target's family with extra keys), without one it fails."""
    cfg_file = Path(drafter_dir) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["model_type"] = json.loads((Path(target_dir) / "config.json").read_text())["model_type"]
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def read_tensors(target_path: str | Path, want) -> dict[str, torch.Tensor]:
    """Every tensor of the target's safetensors shards whose key satisfies `want`."""
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if want(k)})
    return found


def check_unquantised(hf_cfg, target_path: str | Path) -> None:
    """The drafter copies the target's layers from its safetensors as plain tensors: a
    quantised checkpoint's weights without their scales would give garbage drafts."""
    quant = getattr(hf_cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise ValueError(
            f"the target {target_path} is a quantised checkpoint ({method}); the D3D drafter "
            "reads the target's layers from its safetensors and needs them in bf16, fp16 or "
            "fp32: serve an unquantised checkpoint (SGLang's --quantization may still "
            "quantise the target itself at load)"
        )


def _copy_into(model: nn.Module, tensors: dict[str, torch.Tensor], wanted: tuple[str, ...]) -> None:
    """Copy every parameter under `wanted` from `tensors`; refuse what would leave one unset
    (the layers were materialised empty) or would copy a quantised tensor."""
    params = {k: p for k, p in model.named_parameters() if k.startswith(wanted)}
    missing = sorted(k for k in params if k not in tensors)
    if missing:
        raise FileNotFoundError(
            f"the target's safetensors lack {len(missing)} tensors the drafter needs, e.g. "
            f"{missing[:3]}: a checkpoint whose keys are named otherwise (a multimodal wrapper, "
            "another family's layout) is not supported"
        )
    odd = sorted(k for k in params
                 if tensors[k].dtype not in PLAIN_DTYPES or tensors[k].shape != params[k].shape)
    if odd:
        raise ValueError(
            f"the target's safetensors hold {odd[0]} as {tensors[odd[0]].dtype} "
            f"{tuple(tensors[odd[0]].shape)}: a quantised or reshaped checkpoint is not "
            "supported (the drafter needs plain bf16, fp16 or fp32 layers)"
        )
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key])


def read_embed_and_head(target_path: str | Path, hf_cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors from the target's safetensors shards (tied embeddings: one tensor)."""
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in (EMBED_KEY, HEAD_KEY):
                if key in f.keys():
                    found[key] = f.get_tensor(key)
    if EMBED_KEY not in found:
        raise FileNotFoundError(f"no {EMBED_KEY} in the safetensors files of {target_path}")
    head = found.get(HEAD_KEY)
    if head is None:
        if not getattr(hf_cfg, "tie_word_embeddings", False):
            raise FileNotFoundError(f"no {HEAD_KEY} in the safetensors files of {target_path}")
        head = found[EMBED_KEY]
    return found[EMBED_KEY], head


def concrete_device(device: torch.device | str, gpu_id: int) -> torch.device:
    """A bare "cuda" as the GPU SGLang gave this worker, "cuda:`gpu_id`". SGLang's model runner
    says "cuda" while a drafter built there says "cuda:N"; the two compare unequal, and the
    drafter would load a second embedding and head (about 2.5 GB for Qwen3-8B)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", gpu_id)
    return device


def placement(target: torch.device | str, draft: str, gpu_id: int) -> tuple[torch.device, torch.device]:
    """-> (the target's device, the drafter's), both concrete. `draft`: SGLANG_D3D_DRAFT_DEVICE
    ("" = the target's device)."""
    target = concrete_device(target, gpu_id)
    return target, concrete_device(draft or target, gpu_id)


def shared_target_weights(model, vocab_size: int, tp_size: int, target_device: torch.device,
                          draft_device: torch.device):
    """SGLang's own embedding and head as [V, H] views, when they hold the whole vocabulary
    and the drafter runs on the target's device (both concrete: `concrete_device`).

    -> (embed, head), or (None, None) when they are sharded (tensor parallel), quantised, or
    on another device. SGLang pads the vocabulary dimension; the views drop the padding.
    """
    if tp_size != 1 or torch.device(target_device) != torch.device(draft_device):
        return None, None
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    ok = [w for w in (embed, head) if isinstance(w, torch.Tensor) and w.is_floating_point()]
    if len(ok) != 2 or min(w.shape[0] for w in ok) < vocab_size:
        return None, None
    return embed[:vocab_size], head[:vocab_size]


def _frozen_embedding(weight: torch.Tensor) -> nn.Embedding:
    emb = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    emb.weight = nn.Parameter(weight, requires_grad=False)
    return emb


def _frozen_head(weight: torch.Tensor) -> nn.Linear:
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def is_full_depth(drafter_path: str | Path, num_target_layers: int) -> bool:
    """The drafter runs every target layer in order (models/drafter.py `is_full_depth`)."""
    layers = json.loads((Path(drafter_path) / "config.json").read_text())["source_layers"]
    return list(layers) == list(range(num_target_layers))


def build_shared_drafter(
    drafter_path: str | Path,
    hf_cfg,  # the target's Hugging Face config, as SGLang loaded it
    sglang_model,  # SGLang's loaded target (tensor parallel size 1)
    device: torch.device | str,
    embed: torch.Tensor,  # [V, H] SGLang's embedding
    head: torch.Tensor,  # [V, H] SGLang's LM head
) -> D3DDrafter:
    """A full-depth drafter whose layers, final norm, embedding and head are SGLang's own
    tensors (views, no copy; sglang_worker/pool_draft.py): it holds only its deltas and mask
    embedding. Raises ValueError where SGLang's tensors cannot be shared (quantised, repacked).
    Nothing is read from the target's files: a hub id serves as well as a local folder."""
    from transformers import AutoModelForCausalLM

    from sglang_d3d.sglang_worker.pool_draft import LayerViews, tie_to_sglang

    check_architecture(hf_cfg)
    heads, kv_heads = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    views = LayerViews(heads * head_dim, kv_heads * head_dim, hf_cfg.intermediate_size)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=embed.dtype)
    tie_to_sglang(hf, sglang_model, range(hf_cfg.num_hidden_layers), views)
    target_print = fingerprint(hf_cfg.model_type, hf_cfg.num_hidden_layers, embed,
                               hf.model.norm.weight)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg).to(device)
    hf.model.embed_tokens = _frozen_embedding(embed)
    hf.lm_head = _frozen_head(head)
    return D3DDrafter.from_pretrained(Path(drafter_path), Decoder.from_hf(hf), target_print).eval()
