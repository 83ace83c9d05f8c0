"""End-to-end run of real SGLang on CPU, with and without D3D, on a tiny random pair.

    python -m sglang_d3d.sglang_worker.cpu_harness.e2e TARGET DRAFTER [BLOCK [DEVICE [BACKEND]]]

DEVICE cpu (default): run in a process of its own with `cpu_harness.subprocess_env()`
(sglang.Engine also sets process-wide state: multiprocessing start method, signal handlers).
DEVICE cuda: no harness; BACKEND triton (default: a TARGET_VERIFY path that takes float32) or
default (SGLang's own choice, fa3 on Hopper, in float16: fa3 takes no float32). Prints one JSON
line:
  baseline  greedy output ids of SGLang without speculative decoding, per prompt
  d3d       the same prompts through `backend.SGLangEngineLoop` (sglang.Engine + D3DWorker,
            submitted together, no --max-running-requests): output ids, finish reasons, and
            SGLang's own speculative counts per request
  seeded    two runs of the same seeded sampling request (reproducibility)
  ruled     greedy under frequency/presence penalties and a logit_bias (RULES), without
            speculation (`ruled_baseline`) and with D3D
  eos       a bias forcing the end-of-sequence token (id 2), with and without ignore_eos
  refused   what SGLang returned for a request D3D cannot verify exactly
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

PROMPTS = [[1, 5, 36, 77, 8], [1, 9, 50, 11, 62, 13, 24], [1, 40, 41], [1, 5, 36, 77, 8, 30, 30]]
MAX_NEW = 16
RULES = {"frequency_penalty": 1.5, "presence_penalty": 0.8, "logit_bias": {"8": -3.0, "30": 2.0}}


def baseline(target: str, device: str, backend: str = "triton") -> dict:
    import sglang

    engine = sglang.Engine(
        model_path=target, device=device, max_running_requests=4, dtype=_dtype(backend),
        skip_tokenizer_init=True, log_level="error", max_total_tokens=4096,
        # With the overlap scheduler, SGLang 0.5.23 counts a penalised request's tokens one
        # step late (measured here: [30, 30, 30, 67, ...] where OpenAI's rule gives
        # [30, 30, 67, ...]); the reference must apply the rule as documented.
        disable_overlap_schedule=True,
        **_attention(device, backend),
    )  # fmt: skip
    try:
        greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
        out = engine.generate(input_ids=PROMPTS, sampling_params=greedy)
        ruled = engine.generate(input_ids=PROMPTS, sampling_params={**greedy, **RULES})
        return {"baseline": [o["output_ids"] for o in out],
                "ruled_baseline": [o["output_ids"] for o in ruled]}
    finally:
        engine.shutdown()


def _attention(device: str, backend: str = "triton") -> dict:
    """The same attention backend for both runs: torch_native on CPU; on CUDA triton, or
    SGLang's default choice."""
    if device == "cpu":
        return dict(attention_backend="torch_native", disable_cuda_graph=True)
    return {} if backend == "default" else dict(attention_backend=backend)


def _dtype(backend: str) -> str:
    return "float16" if backend == "default" else "float32"


def run_d3d(target: str, drafter: str, block: int, device: str, backend: str = "triton") -> dict:
    from sglang_d3d.api import GenerationRequest
    from sglang_d3d.config import EngineConfig, Mode, SamplingParams, SpecConfig
    from sglang_d3d.sglang_worker.backend import build_engine_loop

    cfg = EngineConfig(
        mode=Mode.ASYNC, spec=SpecConfig(block_size=block), target_path=target,
        drafter_path=drafter, device=device, max_batch_size=4, max_context=256,
        dtype=_dtype(backend),
    )  # fmt: skip
    # No --max-running-requests: SGLang and D3D resolve the limit themselves, and the four
    # greedy prompts below run concurrently (the drafter's slots follow SGLang's limit).
    loop = build_engine_loop(
        cfg, max_total_tokens=4096, log_level="error", max_running_requests=None,
        **_attention(device, backend),
    )  # fmt: skip
    loop.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
        result = {
            "d3d": _collect(
                loop, [GenerationRequest(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
            )
        }
        # ignore_eos: a draw of the tiny model's end-of-sequence token would end the answer early
        seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=MAX_NEW,
                                ignore_eos=True)
        result["seeded"] = [
            _collect(loop, [GenerationRequest(f"s{k}", PROMPTS[1], seeded)])["s" + str(k)]["ids"]
            for k in range(2)
        ]
        bias = tuple(sorted((int(t), b) for t, b in RULES["logit_bias"].items()))
        ruled = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, logit_bias=bias,
                               frequency_penalty=RULES["frequency_penalty"],
                               presence_penalty=RULES["presence_penalty"])
        result["ruled"] = _collect(
            loop, [GenerationRequest(f"r{i}", p, ruled) for i, p in enumerate(PROMPTS)]
        )
        forced = ((2, 100.0),)  # the tiny target's eos_token_id
        result["eos"] = _collect(loop, [
            GenerationRequest(f"e{int(ignore)}", PROMPTS[0], SamplingParams(
                temperature=0.0, max_new_tokens=MAX_NEW, logit_bias=forced, ignore_eos=ignore))
            for ignore in (False, True)
        ])
        result["refused"] = _raw(loop, PROMPTS[0], {"temperature": 0, "repetition_penalty": 1.2})
        return result
    finally:
        loop.shutdown(5)


def _collect(loop, reqs) -> dict:
    done, out = threading.Event(), {}
    left = [len(reqs)]

    def on_event(ev):
        rec = out.setdefault(ev.request_id, {"ids": [], "events": 0})
        rec["ids"] += ev.token_ids
        rec["events"] += 1
        if ev.finished:
            s = ev.stats
            rec.update(reason=ev.finish_reason, error=ev.error)
            rec.update(accepted_lengths=s.accepted_lengths if s else None)
            left[0] -= 1
            if left[0] == 0:
                done.set()

    for r in reqs:
        loop.submit(r, on_event)
    if not done.wait(120):
        raise TimeoutError("requests did not finish")
    return out


def _raw(loop, prompt, sampling) -> dict:
    """A request with SGLang-only sampling features, straight to the engine."""
    coro = loop._engine.async_generate(
        input_ids=prompt, sampling_params={**sampling, "max_new_tokens": 4}
    )
    out = asyncio.run_coroutine_threadsafe(coro, loop._loop).result(120)
    return {"ids": out["output_ids"], "finish": out["meta_info"]["finish_reason"]}


def main() -> None:
    target, drafter = sys.argv[1], sys.argv[2]
    block = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    backend = sys.argv[5] if len(sys.argv) > 5 else "triton"
    if device == "cpu":
        from sglang_d3d.sglang_worker.cpu_harness import install

        install()
    result = {"prompts": PROMPTS, "device": device, **baseline(target, device, backend)}
    result.update(run_d3d(target, drafter, block, device, backend))
    print("E2E-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
