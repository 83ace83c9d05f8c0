"""Build an engine from an EngineConfig: load target, drafter and tokenizer."""

from __future__ import annotations

import logging

import torch

from sglang_d3d.config import EngineConfig, Mode
from sglang_d3d.engine import calibration_cache
from sglang_d3d.engine.calibrate import Calibration
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

log = logging.getLogger(__name__)


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
    apply_target_weights(target, cfg.target_weights, cfg.target_path, cfg.device)
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


def build_engine(cfg: EngineConfig, calibrate_now: bool = True) -> tuple[SpecEngine, object]:
    """The engine and its tokenizer; with `calibrate_now` its calibration has run (or come from
    the cache) before it returns."""
    engine, tokenizer, calibration = _build(cfg)
    if calibrate_now and calibration is not None:
        calibration.run()
    return engine, tokenizer


def build_engine_loop(cfg: EngineConfig) -> EngineLoop:
    """The engine on its loop, ready to serve at once: its calibration (where one is due) runs
    on the loop thread while no request is in, and pauses for any that arrives."""
    engine, tokenizer, calibration = _build(cfg)
    return EngineLoop(engine, tokenizer, calibration)


def _build(cfg: EngineConfig) -> tuple[SpecEngine, object, Calibration | None]:
    target, drafter, tokenizer = load_models(cfg)
    eos = eos_token_ids(target, tokenizer)
    grammars = tokenizer_grammars(tokenizer, target.arch.vocab_size, eos)
    engine = SpecEngine(cfg, target, drafter, eos, grammars)
    calibration = (start_calibration(engine, cfg, drafter is not None)
                   if cfg.adaptive and cfg.calibrate else None)
    return engine, tokenizer, calibration


def start_calibration(engine: SpecEngine, cfg: EngineConfig,
                      has_drafter: bool = True) -> Calibration | None:
    """The controller seeded with the times an earlier start measured on this CPU, these weights
    and these settings (engine/calibration_cache.py), and a Calibration of the batch sizes still
    unmeasured, which stores its times when done; None when nothing is left to measure."""
    drafter_dir = str(resolve_drafter_path(cfg.drafter_path)) if has_drafter else None
    key = calibration_cache.cache_key(cfg, str(resolve_target_path(cfg.target_path)), drafter_dir)
    cached = calibration_cache.load(key)
    for b, plan, seconds, samples in cached:
        engine.controller.seed_time(b, plan, seconds, samples)
    known = tuple(sorted({b for b, *_ in cached}))
    if cached:
        log.info("calibration: reusing the times measured at an earlier start for batch sizes "
                 "%s (%s)", list(known), calibration_cache.cache_dir())
    run = Calibration(engine, known=known,
                      on_done=lambda times: calibration_cache.save(key, cached + times))
    return None if run.done else run
