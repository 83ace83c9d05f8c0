"""The drafter's cache inside SGLang's memory budget.

SGLang 0.5.23 builds the speculative worker before it sizes its KV pool, and then gives the
pool what is free minus its runtime slack (mem_cache/kv_cache_configurator.py
`_profile_available_bytes`):

    pool = free memory - pre_model_load_memory * (1 - mem_fraction_static)

The drafter's cache (dense: one row per running request, each as long as the target's context)
is allocated first, so it comes out of that pool. A long-context target with a deep drafter
easily asks more than the GPU has (Qwen3-8B's 40,960 tokens x 36 layers x 32 slots: about
190 GB in bf16), and SGLang then fails at start with an out-of-memory error that names neither
the drafter nor the flags that size it. The worker checks first and refuses with both.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_d3d.config import SpecConfig
from sglang_d3d.speculative.drafting import draft_cache_len, max_branches

# The most of SGLang's KV pool the drafter's cache may take: the target keeps at least as many
# bytes of KV cache as the drafter.
MAX_POOL_SHARE = 0.5
# On a GPU of its own (SGLANG_D3D_DRAFT_DEVICE), what the cache may take of the free memory;
# the rest is the drafter's activations.
MAX_FREE_SHARE = 0.9


@dataclass(frozen=True)
class CacheShape:
    """What the drafter's cache holds: K and V for every layer, slot and position."""

    layers: int
    slots: int
    positions: int  # per slot: the target's context plus one cycle's scratch
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def num_bytes(self) -> int:
        return 2 * self.layers * self.slots * self.positions * self.kv_heads * self.head_dim * (
            self.dtype_bytes)


def cache_shape(drafter, slots: int, context: int, spec: SpecConfig) -> CacheShape:
    """The cache `Drafting.create(drafter, slots, context, spec)` would allocate."""
    arch = drafter.arch
    positions = draft_cache_len(context, spec.block_size, drafter.cfg.smallest_block,
                                max_branches(spec))
    return CacheShape(drafter.num_layers, slots, positions, arch.num_kv_heads, arch.head_dim,
                      drafter.mask_embedding.element_size())


def pool_budget(free_bytes: int, pre_model_load_bytes: float, mem_fraction_static: float) -> float:
    """The bytes SGLang would give its KV pool now (the formula above)."""
    return free_bytes - pre_model_load_bytes * (1 - mem_fraction_static)


def check_cache(shape: CacheShape, budget: float, share: float) -> None:
    """Raise MemoryError, with the numbers and the flags to change, when the cache would take
    more than `share` of `budget` bytes."""
    if shape.num_bytes <= share * budget:
        return
    gb = 1 << 30
    raise MemoryError(
        f"the D3D drafter's cache needs {shape.num_bytes / gb:.1f} GB ({shape.slots} slots x "
        f"{shape.positions} positions x {shape.layers} layers), more than {share:.0%} of the "
        f"{max(budget, 0) / gb:.1f} GB available for KV caches on its device; lower "
        "--max-running-requests (one slot each) or --context-length, or put the drafter on "
        "a GPU of its own (SGLANG_D3D_DRAFT_DEVICE)"
    )


# ---- a full-depth drafter that shares the target (pool_draft.py) ------------------------------
# What the shared drafter's per-pass scratch and the verification buffers may take of the
# activation headroom SGLang keeps outside `--mem-fraction-static` (they are live during decode
# cycles, when no prefill activations are): half, the rest stays SGLang's.
MAX_HEADROOM_SHARE = 0.5
MB = 1 << 20


@dataclass(frozen=True)
class TargetShape:
    """What the memory plan needs of a target (its Hugging Face config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int  # parameter count
    dtype_bytes: int = 2  # bf16

    @classmethod
    def from_hf(cls, cfg, params: int, dtype_bytes: int) -> TargetShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, head_dim, cfg.intermediate_size, cfg.vocab_size,
                   params, dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def delta_bytes(self, rank: int) -> int:
        """The drafter's own tensors at full depth: a rank-`rank` delta (A [r, in], B [out, r])
        on each of q, k, v, o, gate, up, down of every layer, and the mask embedding."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, \
            self.intermediate
        per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
        return (self.layers * per_layer + h) * self.dtype_bytes


def sglang_headroom_mb(gpu_mb: float, chunked_prefill_size: int = 8192, tp_size: int = 1) -> float:
    """The memory SGLang 0.5.23 keeps outside --mem-fraction-static when the flag is not given
    (arg_groups/memory_hook.py, CUDA graphs off as under D3D): 512 MB, 1.5 MB per
    activation token, parallel slack, at least 10 GB on a GPU of more than 60 GB."""
    reserved = 512 + max(chunked_prefill_size, 2048) * 1.5 + tp_size / 8 * 1024
    if gpu_mb > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return reserved


@dataclass(frozen=True)
class SharedPlan:
    """One GPU's memory with a full-depth drafter that shares the target (bytes)."""

    gpu: float
    mem_fraction_static: float
    context: int
    slots: int
    block: int
    weights: float  # the target's (SGLang's), the drafter's layers included
    drafter_own: float  # deltas and mask embedding
    draft_scratch: float  # one draft pass: prefix gather, block activations, draft logits
    verify_buffers: float  # verify logits and the sampled rows' distributions, float32
    kv_pool: float  # what is left for SGLang's KV pool
    kv_tokens: int

    @property
    def headroom(self) -> float:
        return self.gpu * (1 - self.mem_fraction_static)

    @property
    def problem(self) -> str | None:
        """Why it does not fit (naming the flag to change), or None."""
        gb = 1 << 30
        if self.kv_tokens < self.context + self.block:
            return (f"SGLang's KV pool would hold {self.kv_tokens} tokens ({self.kv_pool / gb:.1f}"
                    f" GB after {self.weights / gb:.1f} GB of weights), fewer than one request "
                    f"at --context-length {self.context}: lower --context-length or raise "
                    "--mem-fraction-static")
        scratch = self.draft_scratch + self.verify_buffers
        if scratch > MAX_HEADROOM_SHARE * self.headroom:
            return (f"the D3D draft and verify buffers need {scratch / gb:.2f} GB at "
                    f"--max-running-requests {self.slots} and --speculative-num-draft-tokens "
                    f"{self.block}, more than {MAX_HEADROOM_SHARE:.0%} of the "
                    f"{self.headroom / gb:.1f} GB SGLang keeps outside --mem-fraction-static "
                    f"{self.mem_fraction_static}: lower --max-running-requests or "
                    "--speculative-num-draft-tokens, or lower --mem-fraction-static")
        return None

    @property
    def fits(self) -> bool:
        return self.problem is None


def shared_plan(shape: TargetShape, gpu_bytes: float, mem_fraction_static: float, context: int,
                slots: int, block: int, rank: int, gather_bytes: int) -> SharedPlan:
    """The memory plan of SGLang + a shared full-depth drafter on one GPU."""
    weights = shape.params * shape.dtype_bytes
    own = shape.delta_bytes(rank)
    width = max(2 * shape.intermediate, (shape.heads + 2 * shape.kv_heads) * shape.head_dim)
    activations = 4 * slots * block * width * shape.dtype_bytes  # a layer's live tensors
    draft_logits = slots * (block - 1) * shape.vocab * 4
    scratch = gather_bytes + activations + draft_logits
    # SGLang's verify logits, then target and proposal distributions and a reshaped copy
    verify = 4 * slots * block * shape.vocab * 4
    kv_pool = gpu_bytes * mem_fraction_static - weights - own
    return SharedPlan(gpu_bytes, mem_fraction_static, context, slots, block, weights, own,
                      scratch, verify, kv_pool, int(max(kv_pool, 0) // shape.kv_bytes_per_token))
