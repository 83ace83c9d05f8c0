"""`d3d`: generate | bench | serve | bench-serving | datagen | train | prune | corpus | compact."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from sglang_d3d.cli_args import add_engine_args, add_request_args, engine_config, request_fields
from sglang_d3d.config import SamplingParams
from sglang_d3d.models.architectures import UnsupportedArchitectureError
from sglang_d3d.speculative.grammar import GrammarError

# Subcommands implemented elsewhere: name -> (module, add-args function, run function).
DELEGATED = {
    "datagen": ("sglang_d3d.training.datagen", "add_datagen_args", "run_datagen"),
    "train": ("sglang_d3d.training.train", "add_train_args", "run_train"),
    "prune": ("sglang_d3d.training.prune", "add_prune_args", "run_prune"),
    "corpus": ("sglang_d3d.training.corpus", "add_corpus_args", "run_corpus"),
    "compact": ("sglang_d3d.training.compact", "add_compact_args", "run_compact"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except UnsupportedArchitectureError as e:  # the user's target: one line, no traceback
        print(f"d3d: {e}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # the server owns its full option set
        from sglang_d3d.server.main import run_server

        return run_server(argv[1:]) or 0
    if argv[:1] == ["bench-serving"]:
        return _bench_serving(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


def _bench_serving(argv: list[str]) -> int:
    """benchmarks/bench_serving.py, installed as sglang_d3d.benchmarks (pyproject.toml)."""
    from sglang_d3d.benchmarks.bench_serving import main as bench_serving

    return bench_serving(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="d3d", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="OpenAI-compatible server (d3d serve --help)")
    sub.add_parser("bench-serving", help="load test a live server (d3d bench-serving --help)")
    g = sub.add_parser("generate", help="generate one completion")
    add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the user turn (chat-templated unless --raw)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed of a sampled request")
    add_request_args(g)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--json", action="store_true", help="one JSON object with text, ids, stats")
    g.set_defaults(func=run_generate)
    from sglang_d3d.bench import add_bench_args, run_bench

    b = sub.add_parser("bench", help="ar / sync / async side by side")
    add_bench_args(b)
    b.set_defaults(func=run_bench)
    for name, (mod, add, run) in DELEGATED.items():
        _add_delegated(sub, name, mod, add, run)
    return p


def _add_delegated(sub, name: str, mod: str, add: str, run: str) -> None:
    try:
        m = importlib.import_module(mod)
    except ImportError as e:  # the training extras are optional at run time
        sub.add_parser(name, help=f"(unavailable: {e})")
        return
    p = sub.add_parser(name, help=(m.__doc__ or "").strip().splitlines()[0] if m.__doc__ else None)
    getattr(m, add)(p)
    p.set_defaults(func=getattr(m, run))


def run_generate(args: argparse.Namespace) -> int:
    from sglang_d3d.engine.factory import build_engine
    from sglang_d3d.engine.offline import generate
    from sglang_d3d.prompts import chat_ids

    engine, tok = build_engine(engine_config(args))
    ids = tok.encode(args.prompt) if args.raw else chat_ids(tok, args.prompt)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop_token_ids=(tok.eos_token_id,),
        **request_fields(args),
    )
    t0 = time.perf_counter()
    try:
        out = generate(engine, [ids], params)[0]
    except GrammarError as e:  # a source that does not compile: the user's input
        print(f"d3d generate: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    text = tok.decode(out.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "seconds": dt, "tokens_per_s": len(out.token_ids) / dt, "stats": out.stats.to_dict(),
        }))
    else:
        print(text)
    engine.shutdown()
    return 0 if out.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
