"""The D3D drafter: an independent block-diffusion decoder.

It keeps its own KV cache of the accepted prefix (it never reads the target's hidden states)
and fills a block of mask slots in one pass: causal over the prefix, bidirectional inside the
block. It is a short stack of target-style decoder layers initialised from the target's own
layers; the embedding and LM head are the target's, frozen and shared (not stored in the
checkpoint), so the checkpoint holds only the layers, the final norm and the mask embedding.
An optional restricted head (FR-Spec style) scores only the K most frequent tokens, since the
full-vocabulary LM head dominates the drafter's cost on small models.

BLOCK LAYOUTS (docs/design.md; the checkpoint records which one it was trained with):
- "masks": B mask slots at positions a+1..a+B after the last accepted token x_a; slot j is
  labelled x_{a+j} (it restores the token at its own position).
- "anchor": the anchor x_a itself predicts x_{a+1} and B-1 mask slots at positions a+1..a+B-1
  predict x_{a+j+1} (every position predicts the next token, as an AR head does).
Either way a block gives B predictions: B-1 drafts and a guess of the bonus token. Masks see
the prefix, the anchor and each other; the anchor is causal.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_d3d.models.decoder import Batch, Decoder, run_layers
from sglang_d3d.models.kv_cache import KVCache

MASK_ID = -1  # input id of a mask slot
CHECKPOINT_VERSION = 1
LAYOUTS = ("masks", "anchor")


@dataclass(frozen=True)
class DrafterConfig:
    source_layers: tuple[int, ...]  # target layers the drafter was initialised from
    block_size: int  # mask slots per block it was trained for
    base_model_type: str  # the target family ("llama", "qwen3")
    vocab_size: int
    head_size: int = 0  # >0: restricted head over this many token ids (stored in the checkpoint)
    version: int = CHECKPOINT_VERSION
    block_layout: str = "masks"  # see LAYOUTS above

    def __post_init__(self) -> None:
        if self.block_layout not in LAYOUTS:
            raise ValueError(f"block_layout must be one of {LAYOUTS}, not {self.block_layout!r}")

    @property
    def anchor_predicts(self) -> bool:
        return self.block_layout == "anchor"

    @property
    def num_layers(self) -> int:
        return len(self.source_layers)


class D3DDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target: Decoder, layers: nn.ModuleList, norm) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec = target.spec
        self.layers = layers
        self.norm = norm
        self.mask_embedding = nn.Parameter(target.embed_tokens.weight.mean(0).detach().clone())
        # Shared with the target and frozen: kept out of parameters() and of the checkpoint.
        self._shared = {"embed": target.embed_tokens, "head": target.lm_head, "rot": target.rotary}
        self.register_buffer("head_ids", None, persistent=False)
        self._head_weight: torch.Tensor | None = None

    # ---- construction and checkpoints -------------------------------------------------------
    @classmethod
    def init_from_target(
        cls, target: Decoder, layer_ids: list[int], block_size: int, block_layout: str = "masks"
    ) -> D3DDrafter:
        layers = nn.ModuleList(copy.deepcopy(target.layers[i]) for i in layer_ids)
        cfg = DrafterConfig(
            source_layers=tuple(layer_ids),
            block_size=block_size,
            base_model_type=target.hf_config.model_type,
            vocab_size=target.spec.vocab_size,
            block_layout=block_layout,
        )
        drafter = cls(cfg, target, layers, copy.deepcopy(target.norm))
        return drafter.to(target.dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Decoder) -> D3DDrafter:
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        raw["source_layers"] = tuple(raw["source_layers"])
        known = {f.name for f in fields(DrafterConfig)}
        cfg = DrafterConfig(**{k: v for k, v in raw.items() if k in known})
        if cfg.vocab_size != target.spec.vocab_size:
            raise ValueError(
                f"drafter at {path} was built for vocab {cfg.vocab_size}, "
                f"target has {target.spec.vocab_size}"
            )
        layers = nn.ModuleList(copy.deepcopy(target.layers[i]) for i in cfg.source_layers)
        drafter = cls(cfg, target, layers, copy.deepcopy(target.norm))
        state = load_file(str(path / "model.safetensors"))
        head_ids = state.pop("head_ids", None)
        drafter.load_state_dict(state, strict=True)
        drafter = drafter.to(target.dtype)
        if head_ids is not None:
            drafter.set_head(head_ids.long())
        return drafter.eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.head_ids is not None:
            state["head_ids"] = self.head_ids.to(torch.int32).contiguous()
        save_file(state, str(path / "model.safetensors"))
        cfg = asdict(self.cfg)
        cfg["head_size"] = 0 if self.head_ids is None else int(self.head_ids.numel())
        # SGLang parses --speculative-draft-model-path as a Hugging Face config before any
        # plugin code runs; with the target family's model_type it parses.
        cfg["model_type"] = self.cfg.base_model_type
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    def set_head(self, head_ids: torch.Tensor | None) -> None:
        """Restrict the LM head to `head_ids` [K] (None: full vocabulary)."""
        self.head_ids = head_ids
        w = self._shared["head"].weight
        self._head_weight = None if head_ids is None else w[head_ids.to(w.device)].detach()

    def place(self, device: str | torch.device) -> D3DDrafter:
        """Move to `device`. On a device other than the target's (a second GPU), the drafter
        takes its own copies of the embedding, LM head and rotary tables."""
        device = torch.device(device)
        self.to(device)
        if self._shared["embed"].weight.device != device:
            self._shared = {k: copy.deepcopy(m).to(device) for k, m in self._shared.items()}
            if self.head_ids is not None:
                self.set_head(self.head_ids.to(device))
        return self

    def prune(self, keep: list[int]) -> D3DDrafter:
        """A copy with only the layers at indices `keep` (into self.layers)."""
        clone = copy.deepcopy(self)
        clone.layers = nn.ModuleList(clone.layers[i] for i in keep)
        src = tuple(self.cfg.source_layers[i] for i in keep)
        clone.cfg = DrafterConfig(**{**asdict(self.cfg), "source_layers": src})
        clone._shared = self._shared
        if self.head_ids is not None:
            clone.set_head(self.head_ids)
        return clone

    # ---- forward ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        s = self.spec
        w = self.mask_embedding
        return KVCache(self.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, w.dtype, w.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N, T] with MASK_ID at mask slots -> [N, T, H]."""
        is_mask = input_ids == MASK_ID
        h = self._shared["embed"](input_ids.clamp(min=0))
        return torch.where(is_mask.unsqueeze(-1), self.mask_embedding.to(h.dtype), h)

    def hidden(
        self,
        input_ids: torch.Tensor,  # [N, T]
        positions: torch.Tensor,  # [N, T]
        attn_mask: torch.Tensor,  # [N, T, S] bool
        cache: KVCache | None = None,
        slots: list[int] | None = None,
        write_at: torch.Tensor | None = None,  # [N, T]
    ) -> torch.Tensor:
        b = Batch(positions, attn_mask, cache, slots, write_at)
        h = run_layers(self.layers, self._shared["rot"], self.embed(input_ids), b, self.spec)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]; tokens outside a restricted head get -inf."""
        if self._head_weight is None:
            return self._shared["head"](hidden)
        small = hidden @ self._head_weight.T  # [..., K]
        full = small.new_full((*small.shape[:-1], self.spec.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_ids.to(small.device), small)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K] over head_ids only (training); full vocabulary if unrestricted."""
        if self._head_weight is None:
            return self._shared["head"](hidden)
        return hidden @ self._head_weight.T
