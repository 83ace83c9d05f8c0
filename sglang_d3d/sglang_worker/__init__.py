"""D3D inside SGLang 0.5.23, as a plugin (docs/sglang.md). Nothing here imports sglang_d3d.engine:
the speculative cycle, drafting and the drafter's executor are shared from sglang_d3d.speculative.

- `plugin.py`: the `sglang.srt.plugins` entry point; registers algorithm D3D.
- `spec_algo.py`: the algorithm object SGLang's scheduler dispatches on.
- `validation.py`: server-argument checks and the chain-shaped speculative defaults.
- `options.py`: the plugin's own settings (SGLANG_D3D_* environment variables).
- `worker.py`: D3DWorker, one D3D cycle (speculative/cycle.py) per `forward_batch_generation`.
- `cycle_step.py`: which cycle a batch runs, every verify block as wide as SGLang reserved
  (no sglang import: the worker's contract runs anywhere).
- `memory.py`: the drafter's cache against the KV pool SGLang is about to size.
- `verify_io.py`: the verify block as SGLang sees it (positions, KV slots, committed runs).
- `accept.py`: SGLang sampling parameters -> ours; per-request verification (speculative/verify.py).
- `requests.py`: our record of each SGLang request (drafter slot, DraftState, stats), kept in
  step with SGLang's requests.
- `draft_input.py`: what SGLang carries on a running batch between rounds.
- `drafter_loading.py`: the drafter beside SGLang's loaded target (concrete devices, shared
  embedding/head, unquantised layers only).
- `backend.py`, `backend_convert.py`: `d3d serve --backend sglang` on sglang.Engine.
- `cpu_harness/`: test-only shims and kernel fallbacks that run real SGLang on CPU.
"""
