"""Server-argument checks and defaults for --speculative-algorithm D3D.

SGLang calls `validate_server_args` and `resolve_server_args` during argument resolution with a
stand-in object: reads go to the resolving view, writes are declared as resolutions. Both only
use plain attribute access, so they are tested with a SimpleNamespace.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sglang_d3d.sglang_worker.options import PluginOptions

log = logging.getLogger(__name__)

# Attention backends whose TARGET_VERIFY path takes a linear (non-tree) verify block of a
# dense-attention model at page size 1, and where it would run. torch_native is adapted by the
# worker (verify_io.py) so the CPU tests can run SGLang itself. Not here: trtllm_mha (needs a
# page size of 16-128, D3D writes the verify block at page size 1), and the MLA- and
# sparse-attention backends (no Llama/Qwen3 target runs on them).
SUPPORTED_ATTENTION_BACKENDS: dict[str, str] = {
    "flashinfer": "CUDA",
    "fa3": "CUDA, Hopper",
    "triton": "CUDA",
    "aiter": "ROCm",
    "torch_native": "CPU, tests only",
}
# SGLang's own default (thousands of requests, sized from its KV pool) does not fit: the
# drafter's cache is dense, one slot per running request (docs/sglang.md, "Memory").
DEFAULT_MAX_RUNNING_REQUESTS = 32
DRAFTER_CONFIG_KEYS = ("source_layers", "block_size", "base_model_type", "vocab_size")
MARK_HINT = (
    "python -c 'from sglang_d3d.sglang_worker.drafter_loading import mark_for_sglang; "
    "mark_for_sglang(DRAFTER, TARGET)'"
)


class D3DArgumentError(ValueError):
    """An unsupported --speculative-algorithm D3D combination; the message says what to change."""


def validate_server_args(args) -> None:
    """Raise D3DArgumentError for combinations the D3D worker cannot run."""
    _check_drafter(args)
    _check_attention(args)
    _check_parallelism(args)
    _check_features(args)
    PluginOptions.from_env()  # a bad SGLANG_D3D_* value fails at startup, not on first request


def resolve_server_args(args) -> None:
    """Fill the generic speculative fields SGLang sizes its KV reservation from.

    One verify block = block_size tokens in a chain: num_draft_tokens = block_size,
    topk = 1, num_steps = block_size - 1 (the relation SGLang's chain code assumes).
    Without --max-running-requests, D3D declares its own default: the worker sizes the
    drafter's cache from the resolved limit before SGLang's KV pool takes the remaining memory.
    CUDA graphs are switched off in spec_algo.py (it needs sglang's graph config types).
    """
    block = args.speculative_num_draft_tokens or _drafter_config(args)["block_size"]
    if args.speculative_num_steps not in (None, block - 1):
        log.warning("D3D drafts a whole block in one pass; ignoring --speculative-num-steps")
    args.speculative_num_draft_tokens = int(block)
    args.speculative_num_steps = int(block) - 1
    args.speculative_eagle_topk = 1
    if not args.disable_overlap_schedule:
        # The worker reads each request's committed tokens when it drafts; SGLang's overlap
        # schedule commits them one iteration late.
        log.warning("D3D runs with --disable-overlap-schedule (its drafter overlaps instead)")
        args.disable_overlap_schedule = True
    if args.max_running_requests is None:
        log.warning(
            "D3D runs with --max-running-requests %d (one drafter cache slot per request); "
            "set it to change the limit",
            DEFAULT_MAX_RUNNING_REQUESTS,
        )
        args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS


# ---- checks -----------------------------------------------------------------------------------
def _check_drafter(args) -> None:
    _drafter_config(args)  # raises for a missing, foreign or unmarked drafter
    block = args.speculative_num_draft_tokens
    if block is not None and block < 2:
        raise D3DArgumentError(
            f"--speculative-num-draft-tokens is the D3D block size (last token + drafts) and "
            f"must be >= 2, got {block}"
        )
    target_vocab = _target_vocab_size(args)
    if target_vocab is not None:
        check_vocab(args.speculative_draft_model_path, target_vocab, args.model_path)


def check_vocab(drafter_path: str, target_vocab: int, target_name: str) -> None:
    """Refuse a drafter trained for another vocabulary. Run at start-up for a local target
    folder, and by the worker once SGLang has loaded the target (a hub id has no local config
    at argument time)."""
    cfg = _read_drafter_config(drafter_path)
    if target_vocab != cfg["vocab_size"]:
        raise D3DArgumentError(
            f"the D3D drafter at {drafter_path} was trained for a vocabulary of "
            f"{cfg['vocab_size']} tokens, the target {target_name} has {target_vocab}"
        )


def _drafter_config(args) -> dict:
    return _read_drafter_config(args.speculative_draft_model_path)


def _read_drafter_config(path: str | None) -> dict:
    if not path:
        raise D3DArgumentError(
            "--speculative-algorithm D3D needs --speculative-draft-model-path: a folder with a "
            "D3D drafter checkpoint (config.json + model.safetensors)"
        )
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise D3DArgumentError(
            f"--speculative-draft-model-path {path} is not a local D3D drafter folder "
            "(no config.json); D3D drafters are not fetched from a model hub"
        )
    cfg = json.loads(cfg_file.read_text())
    missing = [k for k in DRAFTER_CONFIG_KEYS if k not in cfg]
    if missing:
        raise D3DArgumentError(
            f"{cfg_file} is not a D3D drafter config (missing {', '.join(missing)}); "
            "EAGLE/DFlash/standalone drafters need their own --speculative-algorithm"
        )
    if "model_type" not in cfg:
        # SGLang reads this config as a Hugging Face config before plugins run (and fails
        # earlier with its own message when the key is missing); checked here for direct callers.
        raise D3DArgumentError(f"{cfg_file} has no model_type; add it with: {MARK_HINT}")
    return cfg


def _target_vocab_size(args) -> int | None:
    cfg_file = Path(args.model_path or "") / "config.json"
    if not cfg_file.is_file():
        return None  # a hub id: SGLang resolves it later; the worker checks at load
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def _check_attention(args) -> None:
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        name = getattr(args, flag, None)
        if name is not None and name not in SUPPORTED_ATTENTION_BACKENDS:
            choices = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ATTENTION_BACKENDS.items())
            raise D3DArgumentError(
                f"attention backend {name} (--{flag.replace('_', '-')}, given or chosen by "
                f"SGLang for this GPU and model) is not supported with D3D: its verify pass "
                f"needs one of {choices}; pass --attention-backend explicitly"
            )
    if args.page_size not in (None, 1):
        raise D3DArgumentError(
            f"--page-size {args.page_size} is not supported with D3D yet: the verify block is "
            "written at token granularity (use --page-size 1)"
        )


def _check_parallelism(args) -> None:
    if args.enable_dp_attention:
        raise D3DArgumentError(
            "--enable-dp-attention is not supported with D3D: idle DP ranks would have to join "
            "the verify collectives without a drafter; use --dp-size without DP attention"
        )
    if args.pp_size != 1:
        raise D3DArgumentError(
            "D3D supports --pp-size 1 only (the drafter runs beside the last stage)"
        )


def _check_features(args) -> None:
    if args.speculative_adaptive:
        raise D3DArgumentError("--speculative-adaptive is not supported with D3D")
    if args.disaggregation_mode not in (None, "null"):
        raise D3DArgumentError(
            "prefill/decode disaggregation is not supported with D3D (the drafter cache is not "
            "transferred between instances)"
        )
    if args.enable_lora:
        raise D3DArgumentError(
            "--enable-lora is not supported with D3D (the drafter has no adapters)"
        )
    if args.device not in (None, "cuda", "cpu") and not str(args.device).startswith("cuda"):
        raise D3DArgumentError(f"D3D runs on CUDA (and on CPU for tests), not on {args.device}")
