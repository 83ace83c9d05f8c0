"""SGLang alone against SGLang + D3D, inside real SGLang, on the same prompts.

    python benchmarks/bench_sglang.py --datasets gsm8k,mt_bench,mbpp --num-prompts 4 \
        --concurrency 1,8 --max-new-tokens 128 --out benchmarks/results/sglang_cpu.json

Both runs use the default pair (SmolLM2-135M-Instruct and the shipped drafter, or --target and
--drafter), the same attention backend (torch_native on CPU, SGLang's choice on CUDA), greedy
decoding and the chat-templated prompts of each dataset. On CPU the script re-runs itself under
the CPU harness (sglang_d3d/sglang_worker/cpu_harness), which lets sglang 0.5.23 run on the CPU
build of PyTorch; `--device cuda` runs it as installed and writes the same JSON.

Per dataset and concurrency (1 = one request at a time; 8 = eight in flight, a new one as each
ends) the JSON holds `sglang_tokens_per_s`, `d3d_tokens_per_s`, `speedup`, `greedy_identical`
(every prompt's output ids equal), and the D3D worker's counters per cycle (target passes, host
copies, attention-metadata plans, drafter prefill tokens, accepted length) with the drafter's
bytes. SGLang alone and SGLang + D3D each run every cell, `--rounds` times, one engine at a time
(SGLang keeps process-wide server arguments), and keeps each side's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

COUNTERS_ENV = "SGLANG_D3D_COUNTERS_FILE"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="gsm8k,mt_bench,mbpp")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--concurrency", default="1,8", help="comma-separated requests in flight")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--target", default="default", help="HF folder (default: SmolLM2-135M)")
    p.add_argument("--drafter", default="default", help="D3D drafter folder")
    p.add_argument("--block", type=int, default=0,
                   help="--speculative-num-draft-tokens (0: the plugin's default)")
    p.add_argument("--mode", default="", choices=("", "sync", "async", "fused"),
                   help="SGLANG_D3D_MODE: sync (always draft, then verify), fused (verify and "
                        "draft the next block in one forward), async or empty (the plan per "
                        "load for a drafter that shares the target)")
    p.add_argument("--branch-budget", type=int, default=4,
                   help="SGLANG_D3D_BRANCH_BUDGET: a fused forward's branches per request "
                        "(at least the block: every outcome has its branch)")
    p.add_argument("--dtype", default="float32", help="both runs' weights (fp32 on CPU)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternating runs of each side per cell (medians kept)")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch threads of SGLang's scheduler, both sides (OMP_NUM_THREADS; "
                        "0: PyTorch's default). One thread keeps a shared machine's load from "
                        "stalling every parallel region")
    p.add_argument("--sides", default="sglang,d3d", help=argparse.SUPPRESS)  # debugging
    p.add_argument("--baseline-overlap", type=int, default=1, choices=(0, 1),
                   help="SGLang alone with its overlap scheduler (1, its default) or without")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.device == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        _reexec_under_cpu_harness(a.threads)
    if a.device == "cpu":
        from sglang_d3d.sglang_worker.cpu_harness import install

        install()
    prompts = load_prompts(a)
    counters_file = Path(tempfile.mkdtemp(prefix="bench-sglang-")) / "counters.json"
    os.environ[COUNTERS_ENV] = str(counters_file)  # read by the scheduler subprocess
    concs = [int(x) for x in a.concurrency.split(",")]
    # One engine at a time (two sglang.Engines in one process share SGLang's global server
    # arguments): each side runs every cell, the sides alternate for --rounds.
    runs: dict = {}
    for _ in range(a.rounds):
        for side in a.sides.split(","):
            loop = start_loop(a, speculative=side == "d3d")
            try:
                for ds, ids in prompts.items():
                    for c in concs:
                        runs.setdefault((ds, c), {}).setdefault(side, []).append(
                            measure(loop, ids, a.max_new_tokens, c, counters_file))
            finally:
                loop.shutdown(5)
    cells: dict = {}
    for (ds, c), sides in runs.items():
        if len(sides) < 2:
            print(ds, c, {k: [round(r["tokens_per_s"], 2) for r in v] for k, v in sides.items()},
                  per_cycle(sides["d3d"][-1]["counters"]) if "d3d" in sides else "")
            continue
        cells.setdefault(ds, {})[str(c)] = cell(sides)
        print(ds, c, json.dumps(_summary(cells[ds][str(c)])), flush=True)
    out = {**run_info(weights=a.dtype), "device": a.device, "args": vars(a),
           "drafter_bytes": _read(counters_file).get("drafter_bytes"), "results": cells}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print_table(cells)


def _reexec_under_cpu_harness(threads: int) -> None:
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env

    env = subprocess_env()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def load_prompts(a) -> dict[str, list[list[int]]]:
    from sglang_d3d.models.loading import load_tokenizer, resolve_target_path
    from sglang_d3d.prompts import chat_ids, load_questions

    tok = load_tokenizer(resolve_target_path(None if a.target == "default" else a.target))
    return {ds: [chat_ids(tok, q) for q in load_questions(ds, a.num_prompts)]
            for ds in a.datasets.split(",")}


def start_loop(a, speculative: bool):
    """SGLang's Engine (with D3D, or alone) behind the server's engine loop, started."""
    from sglang_d3d.config import EngineConfig, Mode, SpecConfig
    from sglang_d3d.sglang_worker.backend import build_engine_loop

    conc = max(int(x) for x in a.concurrency.split(","))
    # SGLANG_D3D_MODE follows the config's mode (backend_convert.plugin_env); a full-depth
    # drafter that shares the target runs `async` as the plan per load (options.py).
    mode = Mode(a.mode or "async") if speculative else Mode.AR
    spec = SpecConfig(branch_budget=a.branch_budget)
    if a.block:
        spec = SpecConfig(block_size=a.block, branch_budget=a.branch_budget)
    cfg = EngineConfig(mode=mode, spec=spec, target_path=None if a.target == "default" else a.target,
                       drafter_path=None if a.drafter == "default" else a.drafter,
                       device=a.device, max_batch_size=conc, max_context=a.context_length,
                       dtype=a.dtype)
    extra = dict(max_running_requests=conc, context_length=a.context_length,
                 max_total_tokens=conc * a.context_length + 512, log_level="error")
    if not a.block and speculative:
        extra["speculative_num_draft_tokens"] = None  # the plugin's own default
    if a.device == "cpu":
        extra.update(attention_backend="torch_native", disable_cuda_graph=True)
    if not speculative and not a.baseline_overlap:
        extra["disable_overlap_schedule"] = True  # the synchronous scheduler D3D runs under
    loop = build_engine_loop(cfg, **extra)
    loop.start()
    return loop


def measure(loop, prompts: list[list[int]], max_new: int, concurrency: int,
            counters_file) -> dict:
    """One side's run of one cell, after a short warm-up of the same shape."""
    generate(loop, [p[:16] for p in prompts[:concurrency]], 8, concurrency)
    before = _read(counters_file)
    ids, tokens, secs = generate(loop, prompts, max_new, concurrency)
    counters = _delta(before, _read(counters_file))
    # Each request's first token comes from its prefill; the rest from the cycles.
    counters["tokens_from_cycles"] = tokens - len(prompts)
    return {"tokens_per_s": tokens / secs, "ids": ids, "counters": counters}


def cell(sides: dict) -> dict:
    """Both sides' runs of one cell -> the reported figures (medians over rounds)."""
    base = statistics.median(r["tokens_per_s"] for r in sides["sglang"])
    d3d = statistics.median(r["tokens_per_s"] for r in sides["d3d"])
    same = [x == y for x, y in zip(sides["sglang"][-1]["ids"], sides["d3d"][-1]["ids"],
                                   strict=True)]
    return {"sglang_tokens_per_s": round(base, 2), "d3d_tokens_per_s": round(d3d, 2),
            "speedup": round(d3d / base, 3), "greedy_identical": all(same),
            "identical_prompts": f"{sum(same)}/{len(same)}",
            "runs_tokens_per_s": {k: [round(r["tokens_per_s"], 2) for r in v]
                                  for k, v in sides.items()},
            "per_cycle": per_cycle(sides["d3d"][-1]["counters"])}


def generate(loop, prompts: list[list[int]], max_new: int, concurrency: int):
    """Greedy answers to `prompts`, at most `concurrency` in flight. -> (ids per prompt,
    tokens generated, seconds)."""
    from sglang_d3d.api import GenerationRequest
    from sglang_d3d.config import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    slots = threading.Semaphore(concurrency)
    done = threading.Semaphore(0)
    errors: list[str] = []
    tag = f"{time.monotonic_ns()}"

    def submit(i: int) -> None:
        def on_event(ev) -> None:
            out[i] += ev.token_ids
            if ev.finished:
                if ev.error:
                    errors.append(ev.error)
                slots.release()
                done.release()

        loop.submit(GenerationRequest(f"b{tag}-{i}", prompts[i], params), on_event)

    t0 = time.perf_counter()
    for i in range(len(prompts)):
        slots.acquire()
        submit(i)
    for _ in prompts:
        if not done.acquire(timeout=1800):
            raise TimeoutError("requests did not finish")
    secs = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return [out[i] for i in range(len(prompts))], sum(len(v) for v in out.values()), secs


def _read(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in ("drafter_bytes", "target_layer_copies")}


def per_cycle(counters: dict | None) -> dict | None:
    """The worker's totals over a cell -> per cycle (cycles: verify cycles run)."""
    if not counters or not counters.get("cycles"):
        return None
    n = counters["cycles"]
    keep = ("target_passes", "host_copies", "metadata_plans", "drafter_passes",
            "drafter_prefill_tokens")
    out = {k: round(counters[k] / n, 3) for k in keep if k in counters}
    for k in ("draft_s", "verify_s", "target_s", "cycle_s"):  # the cycle's parts, host time
        if k in counters:
            out[k.replace("_s", "_ms")] = round(1000 * counters[k] / n, 2)
    out["cycles"] = n
    out["plain_share"] = round(counters.get("plain_steps", 0) / n, 3)
    out["fused_share"] = round(counters.get("fused_steps", 0) / n, 3)
    # tokens per request and cycle: accepted drafts + the target's own token; of speculative
    # cycles alone (a plain cycle gives each request one token)
    rows, plain = counters.get("requests_cycled", 0), counters.get("plain_requests", 0)
    out["accepted_length"] = round(counters["tokens_from_cycles"] / max(rows, 1), 3)
    if "plain_requests" in counters and rows > plain:
        out["spec_accepted_length"] = round((counters["tokens_from_cycles"] - plain)
                                            / (rows - plain), 3)
    return out


def _summary(cell: dict) -> dict:
    return {k: cell[k] for k in ("sglang_tokens_per_s", "d3d_tokens_per_s", "speedup",
                                 "identical_prompts")}


def print_table(cells: dict) -> None:
    print("| dataset | concurrency | SGLang tok/s | SGLang + D3D tok/s | speedup | greedy identical |")
    print("|---|---|---|---|---|---|")
    for ds, by_c in cells.items():
        for c, r in by_c.items():
            print(f"| {ds} | {c} | {r['sglang_tokens_per_s']} | {r['d3d_tokens_per_s']} | "
                  f"{r['speedup']}x | {r['identical_prompts']} |")


if __name__ == "__main__":
    main()
