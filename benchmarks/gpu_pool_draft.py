"""The shared drafter's contract on a GPU without sglang: a random-weight target at the
Qwen3-1.7B shape in SGLang's layout (sglang_worker/contract.py), a full-depth rank-32 drafter
tied to it (no copy of a target layer), and draft passes reading a paged KV pool through a
scattered req_to_token table. Prints the drafter's own bytes, its copies of target tensors and
the draft pass's time per batch size and block.

    python benchmarks/gpu_pool_draft.py --device cuda          # Qwen3-1.7B shape, bf16
    python benchmarks/gpu_pool_draft.py --device cpu --tiny    # the same code at toy sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_shapes import SHAPES, build_drafter, build_target  # noqa: E402
from run_info import run_info  # noqa: E402

from sglang_d3d.sglang_worker.contract import FakePool, sglang_like  # noqa: E402
from sglang_d3d.sglang_worker.counters import layer_copies  # noqa: E402
from sglang_d3d.sglang_worker.drafter_loading import build_shared_drafter  # noqa: E402
from sglang_d3d.sglang_worker.pool_draft import PoolDrafter, own_bytes  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    shape = SHAPES["qwen3-1.7b"].tiny() if a.tiny else SHAPES["qwen3-1.7b"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = build_target(shape, dev, dtype)
    cfg = target.hf_config
    with tempfile.TemporaryDirectory() as tmp:
        build_drafter(target).save_pretrained(Path(tmp) / "d", dtype=dtype)
        sg = sglang_like(_hf_of(target)).to(dev)  # SGLang's layout: its own tensors
        del target  # the drafter below may share only SGLang's
        shared = build_shared_drafter(Path(tmp) / "d", cfg, sg, dev,
                                      sg.model.embed_tokens.weight, sg.lm_head.weight)
    rows = []
    for batch in (1, 8, 32):
        pool, table, idx, lens = _pool(shape, batch, a.context, dev, dtype)
        last = torch.randint(0, shape.vocab, (batch,), device=dev)
        for block in (8, 16):
            drafter = PoolDrafter(shared, pool, table, block)
            for _ in range(2):
                drafter.draft(last, idx, lens, a.context)  # warm-up
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(5):
                drafter.draft(last, idx, lens, a.context)
            sync(dev)
            rows.append({"batch": batch, "block": block,
                         "draft_ms": round((time.perf_counter() - t0) / 5 * 1000, 3)})
            print(json.dumps(rows[-1]), flush=True)
    out = {**run_info(weights=str(dtype).removeprefix("torch.")), "shape": shape.name,
           "device": str(dev), "context": a.context, "drafter_own_bytes": own_bytes(shared),
           "target_layer_copies": layer_copies(shared.layers, sg), "draft_passes": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "draft_passes"}))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _hf_of(target):
    """The HF causal LM's parts that a Decoder keeps, in the model's own nesting."""
    return SimpleNamespace(model=SimpleNamespace(layers=target.layers, norm=target.norm,
                                                 embed_tokens=target.embed_tokens),
                           lm_head=target.lm_head, config=target.hf_config)


def _pool(shape, batch: int, context: int, dev, dtype):
    """Random K/V for `batch` requests of `context` tokens at scattered slots."""
    total = batch * context + 16
    kv = (total, shape.kv_heads, shape.head_dim)
    k = [torch.randn(kv, device=dev, dtype=dtype) for _ in range(shape.layers)]
    v = [torch.randn(kv, device=dev, dtype=dtype) for _ in range(shape.layers)]
    perm = torch.randperm(total, device=dev)[: batch * context].view(batch, context)
    table = torch.zeros(batch, context + 16, dtype=torch.int32, device=dev)
    table[:, :context] = perm.to(torch.int32)
    lens = torch.full((batch,), context, device=dev)
    return FakePool(k, v), table, torch.arange(batch, device=dev), lens


if __name__ == "__main__":
    main()
