"""The engines a user would pick instead, side by side with d3d, on the same prompts.

Same chat-templated GSM8K prompts (the same token ids for every engine), same token budget,
greedy, the same number of CPU threads, prompt by prompt in one process so machine noise hits
them alike. Per engine: tokens/s, time to first token, accepted length where it applies, and
how many outputs equal the engine's own plain decoding.

    hf          Hugging Face `generate` (fp32)
    hf-pld      HF assisted generation with prompt lookup (`prompt_lookup_num_tokens`)
    llama       llama.cpp (llama-cpp-python) on the GGUF the default target comes from
    llama-pld   the same with its prompt-lookup speculation (LlamaPromptLookupDecoding)
    d3d-ar / d3d-sync / d3d-async   this project's engine

NOTE: llama.cpp computes in the GGUF's 4-bit format (Q4_1); HF and d3d compute in fp32 from
the same weights dequantised. Their outputs are not expected to match llama.cpp's.
llama.cpp is a benchmark extra (`make bench-peers` builds it from source), not a dependency.

    make bench-peers    # builds llama.cpp, runs this, plots benchmarks/results/peers.png
    .venv/bin/python benchmarks/bench_peers.py --out benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import eos_token_ids, load_models
from sglang_d3d.engine.offline import generate
from sglang_d3d.models import loading
from sglang_d3d.prompts import chat_ids, load_questions

PEERS = ("hf", "hf-pld", "llama", "llama-pld", "d3d-ar", "d3d-sync", "d3d-async")
PLAIN = {"hf-pld": "hf", "llama-pld": "llama", "d3d-sync": "d3d-ar", "d3d-async": "d3d-ar"}


def main() -> None:
    a = _args()
    questions = load_questions(a.dataset, a.num_prompts)  # a bad --dataset fails before any load
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    runners, tok = _build(a)
    prompts = [chat_ids(tok, q) for q in questions]
    for run in runners.values():
        run(prompts[0], 8)  # warm-up
    results = {name: [] for name in runners}
    for i, ids in enumerate(prompts):
        for name, run in runners.items():
            results[name].append(run(ids, a.max_new_tokens))
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n} {r[-1]['tokens'] / r[-1]['seconds']:.1f}" for n, r in results.items()), flush=True)
    table = {name: _summary(name, rs, results) for name, rs in results.items()}
    _print(table)
    if a.out:
        report = {"args": vars(a), "table": table, "runs": results}
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="gsm8k",
                   help="gsm8k | mt_bench | mbpp (bundled; $D3D_DATASETS overrides) | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup draft length")
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", default=None)
    return p.parse_args()


def _build(a) -> tuple[dict, object]:
    names = a.peers.split(",")
    cfg = EngineConfig(mode=Mode.ASYNC, drafter_path=a.drafter)
    target, drafter, tok = load_models(cfg)
    eos = eos_token_ids(target, tok)
    hf = loading.load_hf_model(loading.default_target_path())
    runners = {}
    for name in names:
        if name.startswith("hf"):
            runners[name] = _hf_runner(hf, tok, a.lookup_tokens if name == "hf-pld" else 0)
        elif name.startswith("llama"):
            run = _llama_runner(a, eos, name == "llama-pld")
            if run is not None:
                runners[name] = run
        else:
            runners[name] = _d3d_runner(name.split("-")[1], a.threads, target, drafter, eos)
    return runners, tok


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


def _llama_runner(a, eos: tuple[int, ...], lookup: bool):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama-cpp-python is not installed (make bench-peers builds it): llama rows skipped")
        return None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=a.lookup_tokens) if lookup else None
    llm = Llama(str(loading.find_default_gguf()), n_ctx=2048, n_threads=a.threads,
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


def _d3d_runner(mode: str, threads: int, target, drafter, eos):
    m = Mode(mode)
    t, d = (threads - threads // 2, threads // 2) if m is Mode.ASYNC and threads >= 2 else (threads, threads)
    cfg = EngineConfig(mode=m, target_threads=t, draft_threads=d)
    engine = SpecEngine(cfg, target, drafter if m is not Mode.AR else None, eos)

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
    return {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens,
            "mean_ttft_ms": round(1e3 * statistics.mean(r["ttft"] for r in rs), 1),
            "accepted_length": round(statistics.mean(acc), 2) if acc else None,
            "same_as_plain": same, "same_as_hf": same_hf, "num_prompts": len(rs)}


def _print(table: dict) -> None:
    print("| engine | tokens/s | TTFT ms | accepted length | outputs = its plain decoding | = HF generate |")
    print("|---|---|---|---|---|---|")
    for name, s in table.items():
        same = "-" if s["same_as_plain"] is None else f"{s['same_as_plain']}/{s['num_prompts']}"
        acc = "-" if s["accepted_length"] is None else s["accepted_length"]
        hf = "-" if s["same_as_hf"] is None else f"{s['same_as_hf']}/{s['num_prompts']}"
        print(f"| {name} | {s['tokens_per_s']} | {s['mean_ttft_ms']} | {acc} | {same} | {hf} |")


if __name__ == "__main__":
    main()
