"""Pure conversions between our engine API and SGLang's Engine: arguments, sampling parameters,
streamed chunks -> TokenEvents, SGLang's per-request speculative counts -> our stats."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from sglang_d3d.api import GenerationRequest, TokenEvent
from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.sglang_worker.drafter_loading import mark_for_sglang
from sglang_d3d.sglang_worker.options import ENV_PREFIX
from sglang_d3d.speculative.stats import CycleStats, RequestStats

# SGLang finish types -> ours ("stop" covers a matched stop token or string)
# What a drafter folder holds besides config.json (models/drafter.py, models/corpus.py).
DRAFTER_FILES = ("model.safetensors", "corpus.npz", "acceptance.json", "config.json")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_kwargs(cfg: EngineConfig) -> dict:
    """sglang.Engine(**kwargs) for an EngineConfig."""
    from sglang_d3d.models.loading import resolve_drafter_path, resolve_target_path

    target = resolve_target_path(cfg.target_path)
    kw = dict(
        model_path=str(target),
        device="cpu" if cfg.device == "cpu" else "cuda",
        dtype="auto" if cfg.dtype == "auto" else cfg.dtype,
        max_running_requests=cfg.max_batch_size,
        skip_tokenizer_init=True,  # the server tokenizes and detokenizes itself
        log_level="warning",
    )
    if cfg.device == "cpu":  # only with the CPU test harness (sglang_worker/cpu_harness)
        kw.update(attention_backend="torch_native", disable_cuda_graph=True)
    if cfg.mode is not Mode.AR:
        kw.update(
            speculative_algorithm="D3D",
            speculative_draft_model_path=str(
                sglang_ready_drafter(resolve_drafter_path(cfg.drafter_path), target)
            ),
            speculative_num_draft_tokens=cfg.spec.block_size,
        )
    return kw


def plugin_env(cfg: EngineConfig) -> dict[str, str]:
    """The SGLANG_D3D_* settings (options.py) for an EngineConfig."""
    s = cfg.spec
    env = {
        "MODE": cfg.mode.value if cfg.mode is not Mode.AR else Mode.ASYNC.value,
        "BRANCH_POLICY": s.branch_policy.value,
        "BRANCH_BUDGET": str(s.branch_budget),
        "GUESSES": str(s.guesses_per_position),
        "DRAFT_DEVICE": cfg.draft_device or "",
        "COPY_NGRAM": str(cfg.copy_ngram),
        "CORPUS_TOKENS": str(cfg.corpus_tokens),
    }
    return {ENV_PREFIX + k: v for k, v in env.items()}


def sglang_ready_drafter(drafter: Path, target: Path) -> Path:
    """A drafter folder SGLang can take as --speculative-draft-model-path: the folder itself
    when its config already has a model_type, else a marked copy in our cache."""
    if "model_type" in json.loads((drafter / "config.json").read_text()):
        return drafter
    from sglang_d3d.models.loading import cache_dir

    key = hashlib.sha256(str(drafter.resolve()).encode()).hexdigest()[:16]
    out = cache_dir() / "sglang-drafters" / key
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for name in DRAFTER_FILES:  # weights, then the corpus its copies come from, if any
            if (drafter / name).exists():
                shutil.copy2(drafter / name, out / name)
        mark_for_sglang(out, target)
    return out


def sampling_params(p: SamplingParams) -> dict:
    out = dict(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_new_tokens=p.max_new_tokens,
    )
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    if p.min_p > 0:
        out["min_p"] = p.min_p
    if p.ignore_eos:
        out["ignore_eos"] = True
    if p.reshapes_logits:  # SGLang's names; the D3D worker verifies under them
        out.update(frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty)
        out["logit_bias"] = {str(t): b for t, b in p.logit_bias} or None
    return out


def event_from_chunk(
    req: GenerationRequest, chunk: dict, sent: int, cfg: EngineConfig, aborted: bool
) -> tuple[TokenEvent, int]:
    """One streamed SGLang chunk (cumulative output_ids) -> (TokenEvent, tokens sent so far)."""
    ids = chunk.get("output_ids") or []
    new = list(ids[sent:])
    meta = chunk.get("meta_info", {})
    finish = meta.get("finish_reason")
    if not finish:
        return TokenEvent(req.request_id, new), sent + len(new)
    reason, error = _finish(finish, aborted)
    stats = stats_from_meta(meta, cfg)
    return TokenEvent(req.request_id, new, True, reason, error, stats), sent + len(new)


def _finish(finish: dict, aborted: bool) -> tuple[str, str | None]:
    kind = finish.get("type")
    if kind == "abort" and not aborted:
        # Aborted by SGLang, not by our caller: e.g. a sampling feature D3D cannot verify.
        return "error", str(finish.get("message") or "aborted by SGLang")
    return FINISH_REASONS.get(kind, "stop"), None


def stats_from_meta(meta: dict, cfg: EngineConfig) -> RequestStats:
    """SGLang's per-request counts -> RequestStats. Its histogram counts verify cycles by the
    number of accepted drafts, which is all the per-cycle lists need."""
    st = RequestStats(mode=cfg.mode.value)
    st.prompt_tokens = int(meta.get("prompt_tokens", 0))
    st.generated_tokens = int(meta.get("completion_tokens", 0))
    hist = meta.get("spec_correct_drafts_histogram") or []
    num_drafts = cfg.spec.block_size - 1
    for accepted, count in enumerate(hist):
        for _ in range(int(count)):
            st.add_cycle(CycleStats(num_drafts, accepted, None, 0.0, 0.0, 0.0, 0.0))
    return st


def cycles_from_stats(st: RequestStats) -> list[CycleStats]:
    """One CycleStats per verify cycle of a finished request (for the cycle listeners)."""
    g = len(st.drafts_per_position)  # drafts proposed per cycle (block_size - 1)
    return [CycleStats(g, n - 1, None, 0.0, 0.0, 0.0, 0.0) for n in st.accepted_lengths]
