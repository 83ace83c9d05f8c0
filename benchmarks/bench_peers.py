"""The engines a user would pick instead, side by side with d3d, on the same prompts.

Per dataset (GSM8K, MT-Bench, code), the same chat-templated prompts (the same token ids for
every engine), same token budget, greedy, the same number of CPU threads, prompt by prompt in
one process so machine noise hits them alike. Per engine: tokens/s, time to first token,
accepted length where it applies, and how many outputs equal the engine's own plain decoding.

    hf          Hugging Face `generate` (fp32)
    hf-pld      HF assisted generation with prompt lookup (`prompt_lookup_num_tokens`)
    llama-cpp   llama.cpp's own C++ decode loop (benchmarks/llama_decode.cpp) on the Q4_1 GGUF the
                default target comes from, linked to the library llama-cpp-python built: the
                prompt in one batch, then one token per llama_decode, timed inside C++
    llama       the same library through llama-cpp-python's Python loop (`Llama.generate`)
    llama-pld   the same with its prompt-lookup speculation (LlamaPromptLookupDecoding)
    llama-f32   llama.cpp on an all-fp32 GGUF of the same weights (benchmarks/gguf_f32.py)
    d3d         this project's engine as `d3d serve` runs it: async, the adaptive controller,
                calibrated at start-up, default `--target-weights` (auto: the default
                target's own 4-bit GGUF weights on a CPU)
    d3d-ar / d3d-sync               plain decoding and sync speculation, same weights
    d3d-fp32 / d3d-ar-fp32          the default configuration and plain decoding on the
                                    dequantised fp32 weights (`--target-weights fp32`)

Peers by arithmetic: d3d and llama (Q4_1) read the same 4-bit weights; d3d-fp32, llama-f32
and HF compute in fp32. Outputs of different arithmetic are not expected to match: the table
counts the outputs equal to d3d `ar`'s and the mean number of tokens before they part.
llama.cpp is a benchmark extra (`make bench-peers` builds it from source and builds
llama-cpp with scripts/build_llama_decode.sh), not a dependency.

    make bench-peers    # builds llama.cpp, runs this, plots benchmarks/results/peers.png
    .venv/bin/python benchmarks/bench_peers.py --out benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.calibrate import CalibrationConfig, calibrate
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import eos_token_ids, load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.models import cpu_kernels, loading
from sglang_d3d.prompts import chat_ids, load_questions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from llama_decode import DEFAULT_BINARY, LlamaDecode, command  # noqa: E402
from run_info import in_repo, run_info  # noqa: E402

PEERS = ("hf", "hf-pld", "llama-cpp", "llama", "llama-pld", "llama-f32", "d3d", "d3d-ar", "d3d-sync",
         "d3d-fp32", "d3d-ar-fp32")
PLAIN = {"hf-pld": "hf", "llama-cpp": "llama", "llama-pld": "llama", "d3d": "d3d-ar", "d3d-sync": "d3d-ar",
         "d3d-fp32": "d3d-ar-fp32"}
D3D = {  # name -> (mode, server's default configuration, target weights)
    "d3d": (Mode.ASYNC, True, "auto"), "d3d-ar": (Mode.AR, False, "auto"),
    "d3d-sync": (Mode.SYNC, False, "auto"), "d3d-fp32": (Mode.ASYNC, True, "fp32"),
    "d3d-ar-fp32": (Mode.AR, False, "fp32"),
}


def main() -> None:
    a = _args()
    # a bad --datasets fails before any load
    questions = {ds: load_questions(ds, a.num_prompts) for ds in a.datasets.split(",")}
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    runners, tok = _build(a)
    args = {k: in_repo(v) if isinstance(v, str) else v for k, v in vars(a).items()}
    report = {**run_info(weights="q4_1 (d3d, llama), fp32 (hf, llama-f32, d3d-*fp32)"), "args": args,
              "kernels": cpu_kernels.describe_cpu(), "llama_cpp_python": _llama_version(),
              "load_average_at_start": os.getloadavg(), "datasets": {}}
    for ds, qs in questions.items():
        table, results = _run_dataset(ds, [chat_ids(tok, q) for q in qs], runners, a)
        report["datasets"][ds] = {"table": table, "runs": results}
        report["load_average_at_end"] = os.getloadavg()  # other work on the machine skews every row
        if a.out:  # after each dataset, so a stopped run keeps the sets it finished
            Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    _print_summary(report["datasets"])


def _run_dataset(ds: str, prompts: list[list[int]], runners: dict, a) -> tuple[dict, dict]:
    for run in runners.values():
        run(prompts[0], 8)  # warm-up
    results = {name: [] for name in runners}
    for i, ids in enumerate(prompts):
        for name, run in runners.items():
            results[name].append(run(ids, a.max_new_tokens))
        print(f"{ds} prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n} {r[-1]['tokens'] / r[-1]['seconds']:.1f}" for n, r in results.items()), flush=True)
    table = {name: _summary(name, rs, results) for name, rs in results.items()}
    print(f"\n{ds}:")
    _print(table)
    return table, results


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="gsm8k,mt_bench,mbpp",
                   help="comma-separated: gsm8k | mt_bench | mbpp (code) (bundled; $D3D_DATASETS "
                   "overrides) | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup draft length")
    p.add_argument("--drafter", default=None)
    p.add_argument("--llama-decode", default=str(DEFAULT_BINARY),
                   help="llama.cpp's C++ decode loop for the llama-cpp row (scripts/build_llama_decode.sh)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def _build(a) -> tuple[dict, object]:
    names = a.peers.split(",")
    models = {}  # target weights -> (target, drafter), loaded once each
    for w in {D3D[n][2] for n in names if n in D3D} or {"auto"}:
        target, drafter, tok = load_models(EngineConfig(mode=Mode.ASYNC, drafter_path=a.drafter,
                                                        target_weights=w))
        models[w] = (target, drafter)
    eos = eos_token_ids(target, tok)
    hf = loading.load_hf_model(loading.default_target_path())
    runners = {}
    for name in names:
        if name.startswith("hf"):
            runners[name] = _hf_runner(hf, tok, a.lookup_tokens if name == "hf-pld" else 0)
        elif name == "llama-cpp":
            run = _llama_cpp_runner(a, eos)
            if run is not None:
                runners[name] = run
        elif name.startswith("llama"):
            run = _llama_runner(a, eos, name == "llama-pld", name == "llama-f32")
            if run is not None:
                runners[name] = run
        else:
            mode, default, weights = D3D[name]
            runners[name] = _d3d_runner(mode, default, a.threads, *models[weights], eos)
    return runners, tok


def _llama_version() -> str | None:
    """The llama-cpp-python release whose library both llama rows run, None where absent."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def _result(ids: list[int], t0: float, first: float | None, accepted=None) -> dict:
    end = time.perf_counter()
    return {"tokens": len(ids), "seconds": end - t0, "ttft": (first or end) - t0,
            "accepted_length": accepted, "token_ids": ids}


def _hf_runner(hf, tok, lookup: int):
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):  # put() gets the prompt first, then each new token
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    def run(ids: list[int], n: int) -> dict:
        streamer, t0 = FirstToken(), time.perf_counter()
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, streamer=streamer,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **extra)
        return _result(out[0, len(ids):].tolist(), t0, streamer.first)

    return run


def _llama_runner(a, eos: tuple[int, ...], lookup: bool, f32: bool = False):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama-cpp-python is not installed (make bench-peers builds it): llama rows skipped")
        return None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=a.lookup_tokens) if lookup else None
    if f32:
        from gguf_f32 import f32_gguf_path  # benchmarks/, on the path when run as a script

        path = f32_gguf_path()
    else:
        path = loading.find_default_gguf()
    llm = Llama(str(path), n_ctx=2048, n_threads=a.threads,
                n_threads_batch=a.threads, draft_model=draft, verbose=False)

    def run(ids: list[int], n: int) -> dict:
        llm.reset()
        out, first, t0 = [], None, time.perf_counter()
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            out.append(int(t))
            if t in eos or len(out) >= n:
                break
        return _result(out, t0, first)

    return run


def _llama_cpp_runner(a, eos: tuple[int, ...]):
    """One llama_decode process for the whole run; its times are taken inside C++."""
    binary = Path(a.llama_decode)
    if not binary.is_file():
        print(f"{binary} is not built (scripts/build_llama_decode.sh builds it): llama-cpp row skipped")
        return None
    proc = LlamaDecode(command(binary, loading.find_default_gguf(), a.threads, eos))

    def run(ids: list[int], n: int) -> dict:
        r = proc.generate(ids, n)
        return {"tokens": len(r["token_ids"]), "seconds": r["seconds"], "ttft": r["ttft_s"],
                "decode_tokens_per_s": r["decode_tokens_per_s"], "accepted_length": None,
                "token_ids": r["token_ids"]}

    return run


def _d3d_runner(m: Mode, default: bool, threads: int, target, drafter, eos):
    """default: `d3d serve`'s configuration (the adaptive controller, calibrated before the
    first request; prompts run one at a time here, so batch 1 is all there is to time)."""
    t, d = (threads - threads // 2, threads // 2) if m is Mode.ASYNC and threads >= 2 else (threads, threads)
    # One request at a time: one cache slot of 1,024 positions (prompt and answer), not the
    # server's 16 x 2,048, so the several engines of a run fit in memory together.
    cfg = EngineConfig(mode=m, target_threads=t, draft_threads=d, adaptive=default,
                       calibrate=default, max_batch_size=1, max_context=1024)
    engine = SpecEngine(cfg, target, drafter if m is not Mode.AR else None, eos)
    if default:
        calibrate(engine, CalibrationConfig(max_batch=1))

    def run(ids: list[int], n: int) -> dict:
        t0 = time.perf_counter()
        out = generate(engine, [ids], SamplingParams(max_new_tokens=n, stop_token_ids=eos))[0]
        s = out.stats
        acc = statistics.mean(s.accepted_lengths) if s.accepted_lengths and m is not Mode.AR else None
        r = _result(out.token_ids, t0, None, acc)
        r["ttft"] = s.queue_time + s.prefill_time
        return r

    return run


def _summary(name: str, rs: list[dict], results: dict) -> dict:
    tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
    acc = [r["accepted_length"] for r in rs if r["accepted_length"] is not None]
    plain = results.get(PLAIN.get(name, ""))
    same = None
    if plain is not None:
        same = sum(r["token_ids"] == p["token_ids"] for r, p in zip(rs, plain))
    hf = results.get("hf")
    same_hf = None if hf is None else sum(r["token_ids"] == p["token_ids"] for r, p in zip(rs, hf))
    ar = results.get("d3d-ar") if name != "d3d-ar" else None
    same_ar = None if ar is None else sum(r["token_ids"] == p["token_ids"] for r, p in zip(rs, ar))
    prefix_ar = None if ar is None else statistics.mean(
        common_prefix(r["token_ids"], p["token_ids"]) for r, p in zip(rs, ar))
    return {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens,
            "mean_ttft_ms": round(1e3 * statistics.mean(r["ttft"] for r in rs), 1),
            "accepted_length": round(statistics.mean(acc), 2) if acc else None,
            "same_as_plain": same, "same_as_hf": same_hf, "same_as_ar": same_ar,
            "prefix_with_ar": None if prefix_ar is None else round(prefix_ar, 1), "num_prompts": len(rs)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _print(table: dict) -> None:
    print("| engine | tokens/s | TTFT ms | accepted length | outputs = its plain decoding | = HF generate "
          "| = d3d ar (mean tokens before they part) |")
    print("|---|---|---|---|---|---|---|")
    for name, s in table.items():
        same = "-" if s["same_as_plain"] is None else f"{s['same_as_plain']}/{s['num_prompts']}"
        acc = "-" if s["accepted_length"] is None else s["accepted_length"]
        hf = "-" if s["same_as_hf"] is None else f"{s['same_as_hf']}/{s['num_prompts']}"
        ar = "-" if s.get("same_as_ar") is None else f"{s['same_as_ar']}/{s['num_prompts']} ({s['prefix_with_ar']})"
        print(f"| {name} | {s['tokens_per_s']} | {s['mean_ttft_ms']} | {acc} | {same} | {hf} | {ar} |")


def _print_summary(datasets: dict) -> None:
    """tokens/s per engine and dataset, and d3d's default over llama.cpp's plain decoding."""
    names = list(next(iter(datasets.values()))["table"])
    print("\n| engine | " + " | ".join(datasets) + " |")
    print("|---|" + "---|" * len(datasets))
    for n in names:
        print(f"| {n} | " + " | ".join(str(d["table"][n]["tokens_per_s"]) for d in datasets.values()) + " |")
    pairs = (("d3d", "llama-cpp"), ("d3d-ar", "llama-cpp"), ("llama-cpp", "llama"), ("d3d", "llama"),
             ("d3d-fp32", "llama-f32"), ("d3d", "d3d-ar"), ("d3d-sync", "d3d-ar"))
    for ours, peer in pairs:
        if ours in names and peer in names:
            ratios = [d["table"][ours]["tokens_per_s"] / d["table"][peer]["tokens_per_s"] for d in datasets.values()]
            print(f"{ours} / {peer}: " + ", ".join(f"{ds} {r:.2f}x" for ds, r in zip(datasets, ratios)))


if __name__ == "__main__":
    main()
