"""Which target architectures this project trains drafters for and serves, checked at load time.

The decoder (models/decoder.py) runs a Hugging Face model's own modules (projections with their
biases, norms, MLP, rotary embedding with its scaling) and computes attention itself. That is
exact for a family whose layer is pre-norm attention + gated MLP, with at most per-head q/k
norms before RoPE and the standard 1/sqrt(head_dim) scaling. Families that add anything else to
the layer would run silently wrong, so they are refused by name, never guessed at:
- Gemma 2/3: extra post-norms, logit soft-capping, query_pre_attn_scalar scaling, (1 + w) norms;
- MoE (Qwen2-MoE, Qwen3-MoE, Mixtral, ...): the MLP is a router over experts, which the
  drafter's per-projection deltas and the fused CPU projections do not cover;
- Phi-3: fused qkv/gate_up projections and partial rotary.

Sliding-window attention (Mistral v0.1; Qwen2/Qwen3 with `use_sliding_window`) is not
computed: attention always spans the whole context. Inside the window the two are the same,
so a target with a window is served with a context no longer than its window
(`check_context`), and refused beyond it.

Pure Python on purpose (no torch import): the CLI checks a folder's config.json before paying
for its weights.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> what the family adds to the plain Llama layer (all honoured by the decoder).
SUPPORTED: dict[str, str] = {
    "llama": "Llama 2/3/3.1/3.2 (large vocabularies, rope scaling, several EOS ids)",
    "mistral": "Mistral (sliding window: context capped at the window)",
    "qwen2": "Qwen2, Qwen2.5 (q/k/v biases, tied embeddings)",
    "qwen3": "Qwen3 dense (per-head q/k norms)",
}


class UnsupportedArchitectureError(ValueError):
    """A target this project cannot run exactly; the message is one line."""


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def check_architecture(cfg) -> None:
    """cfg: a transformers config (or anything with `model_type`). Raises for any family
    outside SUPPORTED, naming it and the supported list."""
    model_type = getattr(cfg, "model_type", None) or "unknown"
    if model_type in SUPPORTED:
        return
    names = getattr(cfg, "architectures", None) or []
    named = f"{model_type} ({', '.join(names)})" if names else model_type
    raise UnsupportedArchitectureError(
        f"unsupported target architecture {named}; supported: {supported_list()}"
    )


def check_config_file(folder: str | Path) -> None:
    """The same check from a model folder's config.json alone (before loading any weight)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    check_architecture(_Raw(raw.get("model_type"), raw.get("architectures")))


class _Raw:
    def __init__(self, model_type: str | None, architectures: list[str] | None) -> None:
        self.model_type, self.architectures = model_type, architectures


def sliding_window(cfg) -> int | None:
    """The attention window of a config, if any layer has one. transformers sets
    `sliding_window` to None where the family switches it off (Qwen2/Qwen3 without
    `use_sliding_window`); `layer_types` says which layers use it where the family mixes."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_context(window: int | None, max_context: int, model_type: str = "target") -> None:
    """Refuse a context longer than the target's attention window: every request then stays
    inside the window, where full attention (what the decoder computes) equals the target's
    sliding-window attention. The window counts the query itself: the token at position p
    sees positions p - window + 1 .. p, so a sequence of `window` tokens is exact."""
    if window is not None and max_context > window:
        raise UnsupportedArchitectureError(
            f"{model_type} attends over a sliding window of {window} tokens and this engine "
            f"attends over the whole context: set the context length (--max-context) to "
            f"{window} or less, not {max_context}"
        )
