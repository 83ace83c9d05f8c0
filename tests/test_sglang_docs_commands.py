"""The SGLang commands docs/sglang.md gives: every `python -m sglang.launch_server` line parses
with SGLang 0.5.23's own argument parser and passes D3D's checks, every `d3d serve --backend
sglang` line parses with ours, and the Qwen3-8B launch command's memory plan fits an 80 GB GPU
(sglang_worker/memory.py `shared_plan`). The sglang-parser tests skip where sglang is absent."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_d3d.sglang_worker.memory import (
    MB,
    SharedPlan,
    TargetShape,
    sglang_headroom_mb,
    shared_plan,
)
from sglang_d3d.sglang_worker.pool_draft import GATHER_BYTES
from sglang_d3d.sglang_worker.validation import DEFAULT_MAX_RUNNING_REQUESTS

DOC = Path(__file__).resolve().parent.parent / "docs" / "sglang.md"
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="sglang not installed")

# Qwen3-8B's and Qwen3-32B's config.json (Hugging Face), bf16
QWEN3_8B = TargetShape(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       intermediate=12288, vocab=151936, params=8_190_735_360)
QWEN3_32B = TargetShape(layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128,
                        intermediate=25600, vocab=151936, params=32_762_123_264)
QWEN3_CONTEXT = 40960  # max_position_embeddings: SGLang's context length without the flag
GPU_80GB = 81_559 * MB  # what an H100 80 GB reports
ADAPTER_RANK = 32


def commands(prefix: str) -> list[list[str]]:
    """Every command in the doc's bash blocks that starts with `prefix` (continuations joined,
    comments and leading VAR=value settings dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if " ".join(words).startswith(prefix):
                out.append(words[len(prefix.split()):])
    return out


def sglang_args(argv: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def plan_for(args, shape: TargetShape, gpu: float) -> SharedPlan:
    """The plan the launch command gets on one GPU of `gpu` bytes: SGLang's own
    --mem-fraction-static default and D3D's --max-running-requests default where not given."""
    mfs = args.mem_fraction_static or round(1 - sglang_headroom_mb(gpu / MB) * MB / gpu, 3)
    slots = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    context = args.context_length or QWEN3_CONTEXT
    return shared_plan(shape, gpu, mfs, context, slots, args.speculative_num_draft_tokens,
                       ADAPTER_RANK, GATHER_BYTES)


def test_the_doc_gives_both_launch_forms():
    assert commands("python -m sglang.launch_server")
    assert commands("d3d serve --backend sglang")


@needs_sglang
def test_every_sglang_launch_command_parses_with_sglangs_parser():
    from sglang_d3d.sglang_worker.validation import (
        _check_attention,
        _check_features,
        _check_parallelism,
    )

    for argv in commands("python -m sglang.launch_server"):
        args = sglang_args(argv)
        assert args.speculative_algorithm == "D3D" or "--speculative-algorithm" not in argv
        if args.speculative_algorithm == "D3D":
            # D3D's own checks that need no drafter folder on disk
            for check in (_check_attention, _check_parallelism, _check_features):
                check(args)


def test_every_d3d_serve_command_parses_with_ours():
    from sglang_d3d.server.args import build_parser  # what `d3d serve` parses with

    for argv in commands("d3d serve --backend sglang"):
        args = build_parser().parse_args(["--backend", "sglang", *argv])
        assert args.backend == "sglang"


@needs_sglang
def test_the_qwen3_8b_launch_command_fits_an_80gb_gpu():
    qwen = [a for a in commands("python -m sglang.launch_server") if "Qwen/Qwen3-8B" in a]
    assert qwen, "docs/sglang.md gives no launch command for Qwen/Qwen3-8B"
    for argv in qwen:
        plan = plan_for(sglang_args(argv), QWEN3_8B, GPU_80GB)
        assert plan.fits, plan.problem
        assert plan.kv_tokens >= plan.context * 4  # room for several full-length requests


def test_an_oversized_plan_is_refused_naming_the_flags():
    args = SimpleNamespace(mem_fraction_static=None, max_running_requests=256,
                           context_length=None, speculative_num_draft_tokens=16)
    plan = plan_for(args, QWEN3_8B, GPU_80GB)
    assert not plan.fits and "--max-running-requests" in plan.problem
    args = SimpleNamespace(mem_fraction_static=0.3, max_running_requests=8,
                           context_length=None, speculative_num_draft_tokens=8)
    plan = plan_for(args, QWEN3_32B, GPU_80GB)
    assert not plan.fits and "--mem-fraction-static" in plan.problem


def test_the_plan_counts_the_drafters_own_tensors_and_the_verify_buffers():
    args = SimpleNamespace(mem_fraction_static=None, max_running_requests=32,
                           context_length=None, speculative_num_draft_tokens=8)
    plan = plan_for(args, QWEN3_8B, GPU_80GB)
    # rank-32 deltas on 7 projections of 36 layers: about 0.2 GB, not a 16 GB copy of the layers
    assert 0.1e9 < plan.drafter_own < 0.5e9
    assert plan.verify_buffers == 4 * 32 * 8 * 151936 * 4
    assert plan.kv_pool == pytest.approx(plan.gpu * plan.mem_fraction_static - plan.weights
                                         - plan.drafter_own)
