"""Build an engine from an EngineConfig: load target, drafter and tokenizer."""

from __future__ import annotations

import torch

from sglang_d3d.config import EngineConfig, Mode
from sglang_d3d.engine.calibrate import calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.loop import EngineLoop
from sglang_d3d.models.decoder import Decoder
from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import (
    load_hf_model,
    load_tokenizer,
    resolve_drafter_path,
    resolve_dtype,
    resolve_target_path,
)
from sglang_d3d.models.q4_target import apply_target_weights
from sglang_d3d.speculative.grammar import tokenizer_grammars


def engine_dtype(name: str, device: str) -> str:
    """The engine's weights: 'auto' is bf16 on a GPU and fp32 on every CPU, AMX or not. The
    CPU passes keep each row's sums in a fixed order in fp32 (so every mode's greedy output is
    plain decoding's), and the default target's 4-bit runner computes in fp32. In bf16 on a
    CPU with AMX neither holds: `make bench-peers` there found the server's configuration
    equal to its plain decoding on 3 of 8 GSM8K prompts, and plain decoding at 28 tokens/s, no
    faster than fp32 weights."""
    if name == "auto" and torch.device(device).type == "cpu":
        return "float32"
    return str(resolve_dtype(name, device)).removeprefix("torch.")


def load_models(cfg: EngineConfig) -> tuple[Decoder, D3DDrafter | None, object]:
    target_path = resolve_target_path(cfg.target_path)
    dtype = engine_dtype(cfg.dtype, cfg.device)
    target = Decoder.from_hf(load_hf_model(target_path, dtype).to(cfg.device))
    # fused mode's passes mix target and drafter rows: its target stays fp32 (config.py)
    setting = "fp32" if cfg.mode is Mode.FUSED else cfg.target_weights
    apply_target_weights(target, setting, cfg.target_path, cfg.device)
    drafter = None
    if cfg.mode is not Mode.AR or cfg.drafter_path is not None:
        drafter = load_drafter(cfg.drafter_path, target, cfg)
    return target, drafter, load_tokenizer(target_path)


def load_drafter(path: str | None, target: Decoder, cfg: EngineConfig) -> D3DDrafter:
    """The drafter folder at `path` (None: the shipped one) over `target`, on cfg's draft
    device."""
    return D3DDrafter.from_pretrained(resolve_drafter_path(path), target).place(
        cfg.resolved_draft_device)


def eos_token_ids(target: Decoder, tokenizer) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares (Llama 3 has two)."""
    ids: set[int] = set()
    for src in (getattr(target.hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return tuple(sorted(ids))


def build_engine(cfg: EngineConfig) -> tuple[SpecEngine, object]:
    target, drafter, tokenizer = load_models(cfg)
    eos = eos_token_ids(target, tokenizer)
    grammars = tokenizer_grammars(tokenizer, target.arch.vocab_size, eos)
    engine = SpecEngine(cfg, target, drafter, eos, grammars)
    if cfg.adaptive and cfg.calibrate:
        calibrate(engine)
    return engine, tokenizer


def build_engine_loop(cfg: EngineConfig) -> EngineLoop:
    engine, tokenizer = build_engine(cfg)
    return EngineLoop(engine, tokenizer)
