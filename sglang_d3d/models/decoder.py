"""Our forward pass over Hugging Face decoder weights (the families in models/architectures.py).

We reuse the HF submodules (projections, norms, MLP, rotary embedding) so the weights and the
maths of each piece stay the library's; only attention is ours, because speculative decoding
needs what the HF cache cannot give cheaply: per-request cache slots, writes at arbitrary
indices (scratch blocks and branches), and explicit boolean attention masks (causal prefix +
bidirectional mask blocks + tree-shaped branches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang_d3d.models.architectures import check_architecture, sliding_window
from sglang_d3d.models.exact_pass import KeyPlan, key_plan
from sglang_d3d.models.fused import FusedLayer, FusedModel
from sglang_d3d.models.kv_cache import KVCache, slot_selector


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    model_type: str = "llama"
    # Not computed (attention spans the whole context): a context longer than this is refused
    # (architectures.check_context). None: no window.
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg) -> DecoderSpec:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            max_position=cfg.max_position_embeddings,
            model_type=cfg.model_type,
            sliding_window=sliding_window(cfg),
        )


@dataclass(frozen=True)
class Segment:
    """One request's run of tokens inside a packed row (several prompts' prefill chunks in
    one pass): inputs [offset, offset + length) of row 0 go to cache row `slot` at indices
    [start, start + length), causally after the `start` entries already there."""

    slot: int
    offset: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def mask(self) -> torch.Tensor | None:
        """[length, end] bool; None when the chunk starts the prompt (plain causal square)."""
        if self.start == 0:
            return None
        return torch.arange(self.end).unsqueeze(0) <= (self.start + torch.arange(self.length)).unsqueeze(1)


@dataclass
class Batch:
    """Where a forward pass reads and writes in the cache. `cache=None`: no cache, and the
    mask is over the T input tokens themselves (training)."""

    positions: torch.Tensor  # [N, T] RoPE positions
    mask: torch.Tensor | None  # [N, T, S] bool, True = may attend; S = span of cache indices read
    cache: KVCache | None = None
    slots: list[int] | None = None  # [N] cache rows (packed: one per segment)
    write_at: torch.Tensor | None = None  # [N, T] cache index of each input token
    row_spans: list[int] | None = None  # per row: cache indices it reads (set by run_layers)
    # Training only: per layer (keys, values) [N, Hkv, P, D] of a frozen prefix the T inputs
    # attend to before themselves; the mask is then [N, T, P + T]. Lets the drafter train its
    # mask blocks with gradients while the clean prefix runs once without (training/objective.py).
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    record: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # if set, each layer appends its (k, v)
    # Packed prefill (N = 1): the row holds several requests' chunks; `mask` is unused, each
    # segment attends causally over its own cache row (masks built once in `prepare`).
    segments: list[Segment] | None = None
    slot_index: torch.Tensor | None = None  # [N, T] cache row of each input (set by prepare)
    segment_masks: list[torch.Tensor | None] | None = None
    # Each query attends alone over exactly the keys it sees (models/exact_pass.py), so its
    # result does not depend on the rest of the pass: the 4-bit target's decode and verify.
    exact_rows: bool = False
    plan: KeyPlan | None = None  # the keys each exact row sees, where known without `mask`

    def prepare(self) -> None:
        """Once per pass: each input's cache row, and per-row key spans (so rows of
        different lengths read only their own keys) or the packed segments' masks."""
        if self.cache is None:
            return
        if self.segments is not None:
            self.slot_index = torch.cat([torch.full((s.length,), s.slot) for s in self.segments])
            self.slot_index = self.slot_index.unsqueeze(0).to(self.positions.device)
            self.segment_masks = [
                None if m is None else m.to(self.positions.device)
                for m in (s.mask() for s in self.segments)
            ]
            return
        n, t = self.positions.shape
        self.slot_index = torch.tensor(self.slots, device=self.positions.device).unsqueeze(1).expand(n, t)
        if self.row_spans is None:
            seen = self.mask.any(1)  # [N, S]
            last = seen.shape[1] - 1 - seen.flip(-1).int().argmax(-1)
            self.row_spans = (last + 1).tolist()


def attention(
    layer, x: torch.Tensor, cos, sin, b: Batch, li: int, arch: DecoderSpec,
    fused: FusedLayer | None = None,
):
    """x: [N, T, H] -> [N, T, H]. `layer` is an HF decoder layer (self_attn submodules);
    `fused`: the same layer's projections fused and packed (target inference only)."""
    a = layer.self_attn
    n, t, _ = x.shape
    q, k, v = _project_qkv(a, x, arch, fused)
    q = q.view(n, t, arch.num_heads, arch.head_dim)
    k = k.view(n, t, arch.num_kv_heads, arch.head_dim)
    v = v.view(n, t, arch.num_kv_heads, arch.head_dim)
    if hasattr(a, "q_norm"):  # Qwen3 normalises q and k per head before RoPE
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)  # k, v: [N, Hkv, T, D]
    if b.record is not None:
        b.record.append((k, v))
    if b.past is not None:
        pk, pv = b.past[li]
        out = _sdpa(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), b.mask)
    elif b.cache is None:
        out = _sdpa(q, k, v, b.mask)
    else:
        b.cache.write(li, b.slot_index, b.write_at, k.transpose(1, 2), v.transpose(1, 2))
        if b.segments is not None:
            out = _segment_attention(q, b, li)
        else:
            out = _cached_attention(q, b, li)
    out = out.transpose(1, 2).reshape(n, t, -1)
    return a.o_proj(out) if fused is None else fused.o(out)


def _project_qkv(a, x: torch.Tensor, arch: DecoderSpec, fused: FusedLayer | None):
    """x [N, T, H] -> q [N, T, Hq*D], k and v [N, T, Hkv*D]."""
    if fused is None:
        return a.q_proj(x), a.k_proj(x), a.v_proj(x)
    kv = arch.num_kv_heads * arch.head_dim
    return fused.qkv(x).split([arch.num_heads * arch.head_dim, kv, kv], dim=-1)


def _sdpa(q, k, v, mask):
    """q [N, Hq, T, D], k/v [N, Hkv, S, D], mask [N, T, S] -> [N, Hq, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)


def _cached_attention(q: torch.Tensor, b: Batch, li: int) -> torch.Tensor:
    """Attention over each row's cache slot. A contiguous run of slots reads as one view;
    otherwise row by row, because gathering scattered slots into one tensor copies every
    key and value each layer (measured: half the time of a 32-row decode step)."""
    sel = slot_selector(b.slots)
    if isinstance(sel, slice) and len(set(b.row_spans)) == 1:
        keys, values = b.cache.read(li, sel, b.row_spans[0])
        return _sdpa(q, keys, values, b.mask[..., : b.row_spans[0]])
    outs = []
    for r, (slot, span) in enumerate(zip(b.slots, b.row_spans)):
        keys, values = b.cache.read(li, slice(slot, slot + 1), span)
        outs.append(_sdpa(q[r : r + 1], keys, values, b.mask[r : r + 1, :, :span]))
    return torch.cat(outs)


def _segment_attention(q: torch.Tensor, b: Batch, li: int) -> torch.Tensor:
    """q [1, Hq, T, D] of a packed row -> [1, Hq, T, D], each segment over its own slot."""
    outs = []
    for s, m in zip(b.segments, b.segment_masks):
        keys, values = b.cache.read(li, slice(s.slot, s.slot + 1), s.end)
        qs = q[:, :, s.offset : s.offset + s.length]
        if m is None:  # causal square: the kernel skips the masked half
            outs.append(F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True))
        else:
            outs.append(_sdpa(qs, keys, values, m.unsqueeze(0)))
    return torch.cat(outs, 2)


# transformers' rope types whose angles depend on the position alone (not on a sequence length)
POSITION_ONLY_ROPE = ("default", "linear", "llama3")


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, T, D] -> (cos, signed sin) [N, 1, T, D], once per pass: with the sign of
    the rotation's first half folded into sin, a layer's RoPE is one roll and three
    elementwise ops, bitwise what HF's rotate_half form gives (negation is exact)."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, T, D]; tables from `rope_tables`. roll swaps the halves:
    x * cos + (-x2, x1) * sin (measured: 11 us against 25 for the slicing form)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def run_layers(
    layers, rotary, h: torch.Tensor, b: Batch, arch: DecoderSpec,
    fused: tuple[FusedLayer, ...] | None = None,
) -> torch.Tensor:
    """h: [N, T, H] embeddings -> [N, T, H] hidden states before the final norm. `fused`:
    packed projections of the same layers, used in place of the HF modules' own."""
    b.prepare()
    cos, sin = rope_tables(*rotary(h, b.positions))
    for li, layer in enumerate(layers):
        if fused is None:
            h = h + attention(layer, layer.input_layernorm(h), cos, sin, b, li, arch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            f = fused[li]
            h = h + attention(layer, f.input_norm(h), cos, sin, b, li, arch, f)
            h = h + f.mlp(f.post_norm(h))
    return h


class Decoder(nn.Module):
    """The target model: HF weights, our attention. Built from a loaded HF causal LM."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        check_architecture(hf_model.config)  # any other family would run silently wrong
        inner = hf_model.model
        self.arch = DecoderSpec.from_hf_config(hf_model.config)
        self.hf_config = hf_model.config
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self._fused: FusedModel | None = None  # built on the first fast pass
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # rope_at's tables

    @classmethod
    def from_hf(cls, hf_model) -> Decoder:
        return cls(hf_model)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def rows_apart(self) -> bool:
        """Its inference passes compute every query's attention alone (4-bit weights,
        models/q4_target.py), so each token of verify width costs an attention pass."""
        return self._fused is not None and self._fused.exact_rows

    def rope_at(self, positions: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_tables(*self.rotary(h, positions)), [N, 1, T, D], for positions [N, T]: read
        from tables of every position up to the largest asked for so far (grown by doubling),
        where the rotary's angles depend on the position alone. A decode step then makes two
        lookups, not the ~12 small torch calls of the rotary, each of which costs several
        times its isolated time after a step's weights have streamed through the caches."""
        if getattr(self.rotary, "rope_type", None) not in POSITION_ONLY_ROPE:
            return rope_tables(*self.rotary(h, positions))
        need = int(positions.max()) + 1
        if self._rope is None or self._rope[0].shape[0] < need:
            size = max(need, 2 * (0 if self._rope is None else self._rope[0].shape[0]), 1024)
            cos, sin = rope_tables(*self.rotary(h, torch.arange(size, device=h.device).unsqueeze(0)))
            self._rope = (cos[0, 0], sin[0, 0])  # [size, D]
        cos, sin = self._rope
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        s = self.arch
        return KVCache(
            self.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, self.dtype, self.device
        )

    def fused(self) -> FusedModel:
        """Fused, packed projections for inference passes (built once, on first use). The
        target's own are never int8; the drafter's int8 copy is its own (models/int8_deltas.py)."""
        if self._fused is None:
            self._fused = FusedModel.from_decoder(self)
        return self._fused

    def use_fused(self, fused: FusedModel) -> None:
        """Inference passes read `fused` from now on in place of the HF modules' own packed
        weights (the GGUF's 4-bit weights: models/q4_target.py)."""
        self._fused = fused

    def forward(
        self, input_ids: torch.Tensor, b: Batch, fast: bool = False,
        pick: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [N, T] -> logits [N, T, V], or [N, P, V] at the positions `pick` [N, P]
        only (a prefill needs one position per prompt, and the LM head over every prompt
        token costs more than the layers of a short prompt). `fast`: the fused projections
        (inference: no gradients reach the HF modules through them)."""
        f = self.fused() if fast else None
        h = self.embed_tokens(input_ids)
        if f is not None and f.exact_rows and b.exact_rows:
            cos, sin = self.rope_at(b.positions, h)
            plan = b.plan if b.plan is not None else key_plan(b.mask)
            return f.lm_head(f.exact(h, cos, sin, b.cache, b.slots, b.write_at, plan))  # normed
        h = run_layers(self.layers, self.rotary, h, b, self.arch, None if f is None else f.layers)
        if pick is not None:
            h = h.gather(1, pick.to(h.device).unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        if f is None:
            return self.lm_head(self.norm(h))
        return f.lm_head(f.norm(h))
