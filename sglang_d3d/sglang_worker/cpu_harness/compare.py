"""Greedy output of SGLang alone against SGLang with D3D, on any pair, and D3D's sampled output.

    python -m sglang_d3d.sglang_worker.cpu_harness.compare TARGET DRAFTER PROMPTS_JSON MAX_NEW
        [DEVICE [DTYPE [TP]]]

PROMPTS_JSON: a list of token-id lists; TP: SGLang's --tp-size for both runs (on CPU, two
ranks need SGLANG_CPU_OMP_THREADS_BIND, e.g. "0|1"). Runs under `cpu_harness.subprocess_env()` on CPU (as
e2e.py). Prints one JSON line, `COMPARE-RESULT {...}`:
  baseline  greedy output ids of SGLang without speculative decoding, per prompt
  d3d       the same prompts through SGLang + D3DWorker: ids, finish reason, error and the
            accepted lengths per cycle
  sampled   the prompts at temperature 0.7 through SGLang + D3D (ids, finish reason, error)
With SGLANG_D3D_BASELINE_CACHE set to a folder, the baseline is kept there and read back for
the same target files, prompts, length, device, dtype and ranks (`kept_baseline`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from sglang_d3d.sglang_worker.cpu_harness.e2e import _attention, _collect

CONTEXT = 512  # the tiny test models' longest


def baseline(target: str, prompts: list, max_new: int, device: str, dtype: str,
             tp: int = 1) -> list:
    import sglang

    engine = sglang.Engine(
        model_path=target, device=device, max_running_requests=len(prompts), dtype=dtype,
        skip_tokenizer_init=True, log_level="error", max_total_tokens=8192,
        context_length=CONTEXT, disable_overlap_schedule=True, tp_size=tp, **_attention(device),
    )  # fmt: skip
    try:
        out = engine.generate(input_ids=prompts,
                              sampling_params={"temperature": 0, "max_new_tokens": max_new})
        return [o["output_ids"] for o in out]
    finally:
        engine.shutdown()


def kept_baseline(target: str, prompts: list, max_new: int, device: str, dtype: str,
                  tp: int = 1) -> list:
    """`baseline`, kept in $SGLANG_D3D_BASELINE_CACHE where that is set. SGLang alone's greedy
    output follows from the target's files, the prompts, the length, device, dtype and ranks;
    each SGLang start costs tens of seconds on CPU, and several test modules compare the same
    tiny target on the same prompts."""
    folder = os.environ.get("SGLANG_D3D_BASELINE_CACHE")
    if not folder:
        return baseline(target, prompts, max_new, device, dtype, tp)
    path = Path(folder) / f"{baseline_key(target, prompts, max_new, device, dtype, tp)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    ids = baseline(target, prompts, max_new, device, dtype, tp)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_text(json.dumps(ids))
    part.replace(path)  # whole or absent, for a reader beside it
    return ids


def baseline_key(target: str, prompts: list, max_new: int, device: str, dtype: str,
                 tp: int) -> str:
    """What SGLang alone's greedy output follows from, hashed: the target folder's files
    (names and bytes) and the run's settings."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(target).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(json.dumps([prompts, max_new, device, dtype, tp]).encode())
    return h.hexdigest()[:32]


def run_d3d(target: str, drafter: str, prompts: list, max_new: int, device: str,
            dtype: str, tp: int = 1) -> dict:
    from sglang_d3d.api import GenerationRequest
    from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
    from sglang_d3d.sglang_worker.backend import build_engine_loop

    block = json.loads((Path(drafter) / "config.json").read_text())["block_size"]  # its own
    # SGLANG_D3D_MODE=sync (every cycle speculates) where the caller sets it; else async, which
    # a shared drafter runs as the plan per load
    mode = Mode(os.environ.get("SGLANG_D3D_MODE", "async"))
    # SGLANG_D3D_BRANCH_BUDGET where the caller sets it (the config's value is what reaches SGLang)
    budget = int(os.environ.get("SGLANG_D3D_BRANCH_BUDGET", SpecConfig().branch_budget))
    cfg = EngineConfig(mode=mode, spec=SpecConfig(block_size=block, branch_budget=budget),
                       target_path=target,
                       drafter_path=drafter, device=device, max_batch_size=len(prompts),
                       max_context=CONTEXT, dtype=dtype)
    # One drafter cache slot per prompt, each CONTEXT long (a full-depth drafter's dense
    # cache for 32 slots of SmolLM2's 8,192 tokens would be 12 GB in float32).
    loop = build_engine_loop(cfg, max_total_tokens=8192, log_level="error",
                             max_running_requests=len(prompts), context_length=CONTEXT,
                             tp_size=tp, **_attention(device))
    loop.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new)
        sampled = SamplingParams(temperature=0.7, seed=11, max_new_tokens=max_new)
        return {
            "d3d": _collect(loop, [GenerationRequest(f"g{i}", p, greedy)
                                   for i, p in enumerate(prompts)]),
            "sampled": _collect(loop, [GenerationRequest(f"s{i}", p, sampled)
                                       for i, p in enumerate(prompts)]),
        }
    finally:
        loop.shutdown(5)


def main() -> None:
    target, drafter, prompts_json, max_new = sys.argv[1:5]
    device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    dtype = sys.argv[6] if len(sys.argv) > 6 else "float32"
    tp = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    prompts, max_new = json.loads(prompts_json), int(max_new)
    if device == "cpu":
        from sglang_d3d.sglang_worker.cpu_harness import install

        install()
    result = {"baseline": kept_baseline(target, prompts, max_new, device, dtype, tp)}
    result.update(run_d3d(target, drafter, prompts, max_new, device, dtype, tp))
    print("COMPARE-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
