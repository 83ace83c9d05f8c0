"""The D3D drafter: an independent block-diffusion decoder.

It keeps its own KV cache of the accepted prefix (it never reads the target's hidden states)
and fills a block in one pass: causal over the prefix, bidirectional inside the block. It is
the target's own layers at `source_layers` (shared and frozen: all of them at full depth, fewer
once pruned) with gated low-rank deltas on mask slots (models/adapters.py), the target's
embedding, final norm and LM head, and a learned mask embedding.

BLOCK LAYOUT (the only one; docs/design.md): after the last accepted token x_a (the ANCHOR, a
clean causal token committed to the cache) come B-1 mask slots at positions a+1 .. a+B-1. Every
block position predicts the next token, as an AR head does: the anchor's output is draft 1
(x_{a+1}), mask slot j's output is draft j+1, and the last slot's output guesses the bonus
token. B positions -> B predictions.

Checkpoint (`save_pretrained`): config.json + model.safetensors holding only the deltas and the
mask embedding. The drafter is rebuilt from the target at load time, so the config records the
target's fingerprint and a different target is refused.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_d3d.models.acceptance import read_accept_prior
from sglang_d3d.models.adapters import Gate, GatedFused, adapted_layer, delta_modules
from sglang_d3d.models.corpus import read_corpus
from sglang_d3d.models.decoder import Batch, Decoder, run_layers
from sglang_d3d.models.delta_store import FLOAT, STORES, decode_state, encode_state
from sglang_d3d.models.exact_drafter import exact_base, exact_hidden, prepare_exact
from sglang_d3d.models.int8_deltas import int8_layer
from sglang_d3d.models.int8_linear import Int8Linear, Int8Setting
from sglang_d3d.models.kv_cache import KVCache

MASK_ID = -1  # input id of a mask slot
CHECKPOINT_VERSION = 2
BLOCK_LAYOUT = "anchor"


class DrafterFormatError(ValueError):
    """A drafter checkpoint this version cannot use (old layout, other target, bad keys)."""


def fingerprint(model_type: str, num_layers: int, embed: torch.Tensor, norm: torch.Tensor) -> str:
    """Identifies a target by its family, depth, first 64 embedding rows and final norm, with
    values rounded to bf16 so the fp32 and bf16 loads of one target agree."""
    h = hashlib.sha256(str((model_type, num_layers)).encode())
    for w in (embed[:64], norm):
        h.update(w.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def target_fingerprint(target: Decoder) -> str:
    return fingerprint(target.hf_config.model_type, target.num_layers,
                       target.embed_tokens.weight, target.norm.weight)


@dataclass(frozen=True)
class DrafterConfig:
    source_layers: tuple[int, ...]  # target layers the drafter runs, in order
    block_size: int  # B: anchor + B-1 mask slots, the largest block it was trained for
    base_model_type: str  # the target family ("llama", "qwen3")
    vocab_size: int
    target_fingerprint: str
    adapter_rank: int = 32
    adapter_alpha: float = 32.0
    min_block_size: int = 0  # >0: trained on mixed block sizes down to this one
    block_layout: str = BLOCK_LAYOUT
    version: int = CHECKPOINT_VERSION
    delta_store: str = FLOAT  # how model.safetensors keeps the deltas (models/delta_store.py)

    def __post_init__(self) -> None:
        if self.block_layout != BLOCK_LAYOUT or self.version != CHECKPOINT_VERSION:
            raise DrafterFormatError(
                f"drafter checkpoint has block layout {self.block_layout!r}, format version "
                f"{self.version}; this release reads only layout {BLOCK_LAYOUT!r}, version "
                f"{CHECKPOINT_VERSION}. Retrain it with `d3d train` (recipes/default_drafter.sh)."
            )
        if self.delta_store not in STORES:
            raise DrafterFormatError(f"unknown delta_store {self.delta_store!r}; this release "
                                     f"reads {sorted(STORES)}")
        if self.block_size < 2 or self.adapter_rank < 1 or not self.source_layers:
            raise DrafterFormatError("block_size >= 2, adapter_rank >= 1 and layers required")

    @property
    def num_layers(self) -> int:
        return len(self.source_layers)

    @property
    def smallest_block(self) -> int:
        """The smallest block it drafts as trained: shorter ones are drafted at this size."""
        return self.min_block_size or self.block_size

    def pack_block(self, block: int) -> int:
        """The block a `block`-token draft is drafted at: at least the smallest trained one.
        Its mask slots attend to each other, so a shorter block would show them a context they
        never saw in training. Only the first `block` predictions are used."""
        return max(block, self.smallest_block)


class D3DDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target: Decoder, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.arch = target.arch
        self.accept_prior: tuple[float, ...] = ()  # held-out rates per draft, if recorded
        self.corpus: list | None = None  # the target's answers it was distilled on (corpus.py)
        self.gate = Gate()
        gen = torch.Generator(device=target.device).manual_seed(seed)  # reproducible init
        self.layers = nn.ModuleList(
            adapted_layer(target.layers[i], cfg.adapter_rank, cfg.adapter_alpha, self.gate, gen)
            for i in cfg.source_layers
        )
        self.mask_embedding = nn.Parameter(target.embed_tokens.weight.mean(0).detach().clone())
        self._fused: dict[bool, tuple[GatedFused, ...]] = {}  # CPU inference path, by int8
        self.int8_setting = Int8Setting()  # how the int8 copies quantise (`use_int8_setting`)
        self._head_int8: Int8Linear | None = None  # the target's LM head in int8, on first use
        self._int8_key: list[int] | None = None  # delta versions the int8 copies were built at
        self._delta_tensors: list[torch.Tensor] | None = None  # every delta's A and B
        # Shared with the target and frozen: kept out of the checkpoint.
        self._shared = {"embed": target.embed_tokens, "head": target.lm_head,
                        "rot": target.rotary, "norm": target.norm, "target": target}

    # ---- construction and checkpoints -------------------------------------------------------
    @classmethod
    def init_from_target(
        cls, target: Decoder, layer_ids: list[int] | None = None, block_size: int = 16,
        rank: int = 32, alpha: float = 32.0, seed: int = 0, min_block: int = 0,
    ) -> D3DDrafter:
        """A fresh drafter over `layer_ids` (None: every target layer); its deltas are zero."""
        ids = tuple(range(target.num_layers)) if layer_ids is None else tuple(layer_ids)
        cfg = DrafterConfig(
            source_layers=ids, block_size=block_size,
            base_model_type=target.hf_config.model_type, vocab_size=target.arch.vocab_size,
            target_fingerprint=target_fingerprint(target), adapter_rank=rank, adapter_alpha=alpha,
            min_block_size=min_block,
        )
        return cls(cfg, target, seed)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Decoder,
                        target_print: str | None = None) -> D3DDrafter:
        """target_print: the target's fingerprint where `target` does not hold its real
        weights yet (SGLang shares tensors it loads later); default: computed from `target`."""
        path = Path(path)
        cfg = read_config(path)
        have = target_print or target_fingerprint(target)
        if cfg.target_fingerprint != have:
            raise DrafterFormatError(
                f"drafter at {path} was trained for another target (fingerprint "
                f"{cfg.target_fingerprint}, this target {have})"
            )
        drafter = cls(cfg, target)
        drafter.load_own_state(drafter.read_stored(path))
        drafter.accept_prior = read_accept_prior(path)
        drafter.corpus = read_corpus(path, cfg.target_fingerprint)
        return drafter.eval()

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint stores: the deltas and the mask embedding."""
        out = {"mask_embedding": self.mask_embedding}
        for name, m in delta_modules(self.layers):
            out[f"delta.{name}.a"], out[f"delta.{name}.b"] = m.delta_a, m.delta_b
        return out

    def read_stored(self, path: Path) -> dict[str, torch.Tensor]:
        """The own state in the checkpoint folder `path`, decoded from its delta store."""
        shapes = {k: v.shape for k, v in self.own_state().items()}
        return decode_state(load_file(str(path / "model.safetensors")), self.cfg.delta_store, shapes)

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.own_state()
        if set(state) != set(mine):
            missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise DrafterFormatError(f"drafter weights do not match: missing {missing[:4]}, "
                                     f"unexpected {extra[:4]}")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(state[k].to(p.dtype))

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        store: str = FLOAT) -> None:
        """store: `float` keeps the deltas in `dtype` (what training resumes from); `int8` or
        `int4` quantises them for shipping (models/delta_store.py)."""
        write_checkpoint(path, self.cfg, self.own_state(), store, dtype)

    def place(self, device: str | torch.device) -> D3DDrafter:
        """On the target's device the drafter shares its weights. On another device (a second
        GPU) it takes its own copy of everything: moving shared parameters in place would
        move the target too."""
        device = torch.device(device)
        if self.mask_embedding.device == device:
            return self
        return copy.deepcopy(self).to(device)

    def prune(self, keep: list[int]) -> D3DDrafter:
        """A drafter with only the layers at indices `keep` (into self.layers); its deltas
        are copies of those layers' deltas."""
        src = self.cfg.source_layers
        cfg = DrafterConfig(**{**asdict(self.cfg), "source_layers": tuple(src[i] for i in keep)})
        clone = D3DDrafter(cfg, self._shared["target"]).to(self.mask_embedding.dtype)
        mine = self.own_state()
        renamed = {"mask_embedding": mine["mask_embedding"]}
        for new, old in enumerate(keep):
            for key, value in mine.items():
                if key.startswith(f"delta.{old}."):
                    renamed[f"delta.{new}." + key.split(".", 2)[2]] = value
        clone.load_own_state(renamed)
        return clone

    # ---- forward ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_full_depth(self) -> bool:
        """Every target layer in order: clean tokens then compute exactly the target."""
        return self.cfg.source_layers == tuple(range(self._shared["target"].num_layers))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.own_state().values())

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        s, w = self.arch, self.mask_embedding
        return KVCache(self.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, w.dtype,
                       w.device)

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
        past: list | None = None,
        record: list | None = None,
        fast: bool = False,
        int8: bool = False,
        coarse: bool = False,
    ) -> torch.Tensor:
        """-> [N, T, H] final-normed hidden states; deltas apply at mask slots only. `fast`
        (inference on CPU): the target's fused, packed projections plus the deltas, in one call
        of the target's C++ layer loop where it has one (a 4-bit target: models/exact_drafter.py);
        `int8`: an int8 copy of those projections and of the deltas (models/int8_deltas.py);
        `coarse`: on the C++ loop, the projections' inputs rounded to 8 bits, not 14 (only with
        the drafter's own `cache`: the rows then differ from the target's)."""
        if fast and not int8 and cache is not None and past is None and record is None \
                and not torch.is_grad_enabled() and self.on_exact_loop():
            return exact_hidden(self, input_ids, positions, attn_mask, cache, slots, write_at,
                                input_ids == MASK_ID, coarse)
        b = Batch(positions, attn_mask, cache, slots, write_at, past=past, record=record)
        self.gate.set(input_ids == MASK_ID, self.mask_embedding.dtype)
        try:
            fused = self.fused_layers(int8) if fast or int8 else None  # int8 is a fast path
            if int8:
                self._refresh(fused)
            h = run_layers(self.layers, self._shared["rot"], self.embed(input_ids), b, self.arch,
                           fused)
        finally:
            self.gate.clear()
        return self._shared["norm"](h)

    def on_exact_loop(self) -> bool:
        """Its fast passes run on the target's C++ 4-bit layer loop (models/exact_drafter.py)."""
        return exact_base(self) is not None

    def prepare_inference(self, int8: bool = False) -> None:
        """Build the fast path and its delta weights now: the first drafter pass otherwise
        pays for them (measured: 115 ms against 50 ms for the next), and the adaptive
        controller would take that first cycle's time for the plan's."""
        for layer in self.fused_layers(int8):  # builds the target's fused model too
            layer.prepare()
        if int8:
            self._int8_head()
        if self.on_exact_loop():  # the passes an int8 runner takes there too (DraftRunner)
            prepare_exact(self)

    def _refresh(self, fused: tuple[GatedFused, ...]) -> None:
        """Rebuild the int8 copies of deltas that changed since they were built (training
        between passes); one version read per delta tensor, once a pass."""
        if self._delta_tensors is None:
            self._delta_tensors = [t for _, m in delta_modules(self.layers)
                                   for t in (m.delta_a, m.delta_b)]
        key = [t._version for t in self._delta_tensors]
        if key != self._int8_key:
            for layer in fused:
                layer.prepare()
            self._int8_key = key

    def use_int8_setting(self, setting: Int8Setting) -> None:
        """Quantise the int8 copies this way from now on (they are rebuilt on next use)."""
        self.int8_setting = setting
        self._fused.pop(True, None)
        self._head_int8, self._int8_key = None, None

    def fused_layers(self, int8: bool = False) -> tuple[GatedFused, ...]:
        """Built on first use, over the target's own fused model (built once, shared): its
        packed projections plus the deltas, or (int8) an int8 copy of both, for the layers
        this drafter keeps."""
        if int8 not in self._fused:
            base = self._shared["target"].fused().layers
            pairs = [(base[i], layer) for i, layer in zip(self.cfg.source_layers, self.layers)]
            self._fused[int8] = tuple(int8_layer(b, layer, self.int8_setting) if int8
                                      else GatedFused.full(b, layer) for b, layer in pairs)
        return self._fused[int8]

    def logits(self, hidden: torch.Tensor, fast: bool = False, int8: bool = False) -> torch.Tensor:
        """[..., H] -> [..., V]. `fast`: the target's packed LM head (about half the time of
        the plain module for a block of 8 on CPU; inference only); `int8`: an int8 copy."""
        if int8:
            return self._int8_head()(hidden)
        if fast:
            return self._shared["target"].fused().lm_head(hidden)
        return self._shared["head"](hidden)

    def _int8_head(self) -> Int8Linear:
        if self._head_int8 is None:
            head = self._shared["head"]
            self._head_int8 = Int8Linear(head.weight, head.bias, self.int8_setting)
        return self._head_int8


def write_checkpoint(path: str | Path, cfg: DrafterConfig, state: dict[str, torch.Tensor],
                     store: str = FLOAT, dtype: torch.dtype = torch.bfloat16) -> None:
    """A drafter folder (config.json + model.safetensors) from its config and own state: what
    `save_pretrained` writes, and `d3d compact` without building the drafter."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(encode_state(state, store, dtype), str(path / "model.safetensors"))
    raw = asdict(replace(cfg, delta_store=store))
    # SGLang parses --speculative-draft-model-path as a Hugging Face config before any
    # plugin code runs; with the target family's model_type it parses.
    raw["model_type"] = cfg.base_model_type
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def read_config(path: Path) -> DrafterConfig:
    raw = json.loads((Path(path) / "config.json").read_text())
    raw.setdefault("block_layout", "masks" if raw.get("version", 1) < 2 else BLOCK_LAYOUT)
    raw.setdefault("target_fingerprint", "")
    raw["source_layers"] = tuple(raw["source_layers"])
    known = {f.name for f in fields(DrafterConfig)}
    try:
        return DrafterConfig(**{k: v for k, v in raw.items() if k in known})
    except DrafterFormatError as e:
        raise DrafterFormatError(f"{path}: {e}") from None
