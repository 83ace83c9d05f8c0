"""Command-line options that mirror EngineConfig/SpecConfig (shared by generate, bench, serve)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from sglang_d3d.config import (
    APART_ROW_BLOCK,
    APART_ROW_WIDTHS,
    DRAFT_INPUT_BITS,
    DRAFT_WEIGHTS,
    JSON_OBJECT,
    SHARED_ROW_WIDTHS,
    TARGET_WEIGHTS,
    BranchPolicy,
    EngineConfig,
    GrammarSpec,
    Mode,
    SamplingParams,
    SpecConfig,
)


def add_engine_args(
    p: argparse.ArgumentParser, modes: bool = False, adaptive: bool = False
) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--target", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--drafter", default=None, help="D3D drafter folder (default: the shipped one)")
    if not modes:
        g.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.ASYNC.value,
                       help="ar: target only; sync: draft then verify; async: pre-draft the next "
                       "block while the target verifies; fused: drafting and verification in one "
                       "pass")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens verified per cycle: the last accepted token and block-1 drafts "
                   f"(default {SpecConfig.block_size}; without --adaptive, {APART_ROW_BLOCK} on "
                   "4-bit target weights, where each token of verify width costs more)")
    g.add_argument("--branch-policy", choices=[b.value for b in BranchPolicy], default="topk",
                   help="which verification outcomes async mode pre-drafts the next block for")
    g.add_argument("--branch-budget", type=int, default=SpecConfig.branch_budget,
                   help="outcomes pre-drafted per cycle under --branch-policy topk")
    g.add_argument("--guesses-per-position", type=int, default=SpecConfig.guesses_per_position,
                   help="guessed correction tokens per rejection position when pre-drafting")
    g.add_argument("--device", default="cpu", help="the target's device: cpu, cuda or cuda:N")
    g.add_argument("--draft-device", default=None, help="e.g. cuda:1 to give the drafter its own GPU")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on GPUs, fp32 on CPUs (where the modes' exactness and the "
                   "4-bit default target need it)")
    g.add_argument("--max-context", type=int, default=EngineConfig.max_context,
                   help="prompt + output tokens per request")
    g.add_argument("--max-batch-size", "--max-concurrency", dest="max_batch_size", type=int,
                   default=EngineConfig.max_batch_size, help="running requests per cycle")
    g.add_argument("--max-queue", type=int, default=EngineConfig.max_queue,
                   help="waiting requests; refused past it (HTTP 503)")
    g.add_argument("--verify-token-budget", type=int, default=EngineConfig.verify_token_budget,
                   help="tokens one verify pass may hold over the whole batch; the block "
                   "shrinks as the batch grows")
    g.add_argument("--min-block-size", type=int, default=EngineConfig.min_block_size,
                   help="below this block size (after --verify-token-budget) decode plainly")
    g.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help="prompt tokens prefilled per step while other requests decode")
    g.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens,
                   help="prompt tokens in one prefill pass when nobody is decoding")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=adaptive,
                   help="choose the block size (or plain decoding) per batch size by measured "
                   f"throughput (default: {'on' if adaptive else 'off'})")
    g.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=adaptive,
                   help="with --adaptive (embedded engine): time every plan at every batch "
                   "size on synthetic requests; `d3d serve` is ready before it and calibrates "
                   "while no request is in (at most 300 s in all, progress in the log), and a "
                   "result is reused at the next start on the same CPU, weights and settings "
                   f"(default: {'on' if adaptive else 'off'})")
    g.add_argument("--draft-weights", choices=list(DRAFT_WEIGHTS), default="auto",
                   help="the drafter's weights on CPU: int8 (a quarter of the bytes per pass; "
                   "the target's outputs are unchanged), full (the target's own: 4-bit where "
                   "--target-weights is q4), or auto: int8 where the drafter runs on a CPU in "
                   "float32")
    g.add_argument("--draft-input-bits", type=int, choices=list(DRAFT_INPUT_BITS),
                   default=EngineConfig.draft_input_bits,
                   help="on a 4-bit target's C++ loop, the bits the drafter's passes keep of "
                   "each block of projection inputs: 14 as the target's passes, or 8 (fewer "
                   "byte products; the target's outputs are unchanged)")
    g.add_argument("--target-weights", choices=list(TARGET_WEIGHTS),
                   default=EngineConfig.target_weights,
                   help="the target's projection weights in its passes: q4 (the 4-bit Q4_1 "
                   "weights of the GGUF it came from, as stored; inputs rounded per block of 32 "
                   "to 14-bit integers), "
                   "fp32 (as loaded; equal to HF generate), or auto: q4 where the target came "
                   "from a Q4_1 GGUF (the default target) and runs on a CPU in float32, else "
                   "fp32 (default auto: q4 is the faster there end to end, docs/benchmarks.md)")
    g.add_argument("--draft-cutoff", type=_cutoff, default=EngineConfig.draft_cutoff,
                   help="sync/async: verify a row's leading drafts while the product of the "
                   "drafter's probabilities of them stays at or above this (0: whole blocks; "
                   f"default {EngineConfig.draft_cutoff}); outputs do not change")
    g.add_argument("--tree-nodes", type=count, default=None,
                   help="sync/async: verify a tree of this many draft tokens (greedy requests: "
                   "the drafter's likeliest paths, several guesses per position; sampled: the "
                   "same shape filled with draws) in cycles without pre-drafting (0: a chain of "
                   f"block-1 drafts; default {SHARED_ROW_WIDTHS[2]}, or {APART_ROW_WIDTHS[2]} on "
                   "4-bit target weights, where verify width costs more, and with --backend "
                   "sglang); outputs do not change (sampled: in distribution)")
    g.add_argument("--lookup-tokens", type=count, default=None,
                   help="add up to this many guesses copied from the request's "
                   "own text (what followed the last earlier occurrence of its latest 2-4 "
                   "tokens) to each token tree (--tree-nodes > 0), under its first draft; a "
                   "verify pass grows by "
                   "them only within --verify-token-budget; also the length of a cycle's copies "
                   f"(--copy-ngram) (0: neither; default {SHARED_ROW_WIDTHS[0]}, or "
                   f"{APART_ROW_WIDTHS[0]} on 4-bit target weights, where verify width costs "
                   "more); outputs "
                   "do not change (sampled: in distribution)")
    g.add_argument("--copy-ngram", type=count, default=None,
                   help="a request whose latest N or more tokens occurred before verifies a copy "
                   "of what followed in place of drafting (no drafter pass where every running "
                   "request has one; sampled requests where the cycle verifies trees) "
                   f"(0: never; default {EngineConfig.copy_ngram}); outputs do not change")
    g.add_argument("--shared-lookup-tokens", type=count, default=EngineConfig.shared_lookup_tokens,
                   help="a greedy request whose own text has no copy (--copy-ngram) looks in the "
                   "last N tokens of finished requests' prompts and answers for what followed "
                   "its last 3 tokens (0: off, e.g. where tenants must not time guesses from "
                   f"each other's text; default {EngineConfig.shared_lookup_tokens}); outputs "
                   "do not change")
    g.add_argument("--corpus-tokens", type=count, default=EngineConfig.corpus_tokens,
                   help="a greedy request with no such copy copies what the target most often "
                   "said after its last 3-6 tokens in the drafter's corpus (the target's own "
                   "answers it was distilled on, corpus.npz in the drafter folder; `d3d corpus` "
                   "writes one), indexing at most N of its tokens (0: off; default "
                   f"{EngineConfig.corpus_tokens}); outputs do not change")
    g.add_argument("--copy-guesses", type=count, default=None,
                   help="a cycle of copies also verifies, beside greedy requests' copies, earlier "
                   "requests' continuations and the corpus's likeliest other guesses, each "
                   "request's as one token tree, at most N guessed tokens a pass shared among "
                   f"its requests (0: copies alone; default {SHARED_ROW_WIDTHS[1]}, or "
                   f"{APART_ROW_WIDTHS[1]} on 4-bit target weights); "
                   "each batch size measures that against copies cut to half their length, "
                   "alone (and at batch 1 whole copies alone), and keeps the fastest; outputs "
                   "do not change")
    g.add_argument("--threads", type=int, default=None, help="CPU threads in all (default: all cores)")


def add_request_args(p: argparse.ArgumentParser) -> None:
    """The rules a request from the command line decodes under: penalties, min-p, a grammar."""
    add_penalty_args(p)
    add_grammar_args(p)


def request_fields(args: argparse.Namespace) -> dict:
    """The SamplingParams fields `add_request_args` sets."""
    return penalty_fields(args) | grammar_field(args)


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    """OpenAI's and vLLM's penalties and min-p, for requests made from the command line."""
    p.add_argument("--frequency-penalty", type=_checked("frequency_penalty"), default=0.0,
                   help="subtract this times a token's count in the output so far from its logit")
    p.add_argument("--presence-penalty", type=_checked("presence_penalty"), default=0.0,
                   help="subtract this from the logit of every token the output already holds")
    p.add_argument("--repetition-penalty", type=_checked("repetition_penalty"), default=1.0,
                   help="vLLM's: shrink the logit of every token in the prompt or output by this")
    p.add_argument("--min-p", type=_checked("min_p"), default=0.0,
                   help="sample only tokens at least this share of the likeliest one's probability")


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """Structured output (speculative/grammar.py), one kind at most."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--response-format", choices=("text", "json"), default="text",
                   help="json: the answer is one JSON object (OpenAI's json_object)")
    g.add_argument("--json-schema", type=_schema, default=None, metavar="SCHEMA",
                   help="the answer follows this JSON schema (JSON text, or @FILE)")
    g.add_argument("--regex", type=_grammar("regex"), default=None,
                   help="the answer matches this regular expression")
    g.add_argument("--ebnf", type=_grammar("ebnf"), default=None,
                   help="the answer follows this EBNF grammar (GBNF-style, a `root` rule)")


def _schema(text: str) -> GrammarSpec:
    """--json-schema: JSON text or @FILE, refused as a usage error unless it is JSON."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {e.strerror}") from e
    try:
        json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    return GrammarSpec("json_schema", text)


def _grammar(kind: str):
    def parse(text: str) -> GrammarSpec:
        try:
            return GrammarSpec(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return parse


def grammar_field(args: argparse.Namespace) -> dict:
    """The SamplingParams grammar `add_grammar_args` sets (None: free text)."""
    asked = args.json_schema or args.regex or args.ebnf
    return {"grammar": JSON_OBJECT if args.response_format == "json" else asked}


def _checked(field: str):
    """An argparse type for a float SamplingParams field: refused as a usage error, before any
    model loads, where SamplingParams would refuse it."""
    def parse(text: str) -> float:
        value = float(text)
        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        return value
    return parse


def penalty_fields(args: argparse.Namespace) -> dict:
    """The SamplingParams fields `add_penalty_args` sets."""
    return dict(frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                repetition_penalty=args.repetition_penalty, min_p=args.min_p)


def count(text: str) -> int:
    """An argparse type: an integer >= 0, refused as a usage error otherwise."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: must be 0 or more")
    return n


def _cutoff(text: str) -> float:
    """--draft-cutoff: a probability in [0, 1), refused as a usage error otherwise."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {value}")
    return value


def split_threads(mode: Mode, total: int | None) -> tuple[int, int]:
    """(target, drafter) intra-op threads. In async mode the two models run at once, so the
    cores are split between them; otherwise each runs alone and gets every core."""
    total = total or os.cpu_count() or 1
    if mode is Mode.ASYNC and total >= 2:
        return total - total // 2, total // 2
    return total, total


def engine_config(args: argparse.Namespace, mode: str | None = None) -> EngineConfig:
    m = Mode(mode or args.mode)
    target_threads, draft_threads = split_threads(m, args.threads)
    spec = SpecConfig(
        block_size=args.block_size or SpecConfig.block_size,
        branch_policy=BranchPolicy(args.branch_policy),
        branch_budget=args.branch_budget,
        guesses_per_position=args.guesses_per_position,
    )
    return EngineConfig(
        mode=m,
        spec=spec,
        target_path=args.target,
        drafter_path=args.drafter,
        device=args.device,
        draft_device=args.draft_device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_context=args.max_context,
        max_queue=args.max_queue,
        verify_token_budget=args.verify_token_budget,
        min_block_size=args.min_block_size,
        fixed_block=args.block_size,
        prefill_chunk=getattr(args, "prefill_chunk", EngineConfig.prefill_chunk),
        max_prefill_tokens=getattr(args, "max_prefill_tokens", EngineConfig.max_prefill_tokens),
        adaptive=getattr(args, "adaptive", False),
        calibrate=getattr(args, "calibrate", False),
        target_threads=target_threads,
        draft_threads=draft_threads,
        draft_weights=getattr(args, "draft_weights", EngineConfig.draft_weights),
        draft_input_bits=getattr(args, "draft_input_bits", EngineConfig.draft_input_bits),
        target_weights=getattr(args, "target_weights", EngineConfig.target_weights),
        draft_cutoff=getattr(args, "draft_cutoff", EngineConfig.draft_cutoff),
        tree_nodes=getattr(args, "tree_nodes", None),
        lookup_tokens=getattr(args, "lookup_tokens", None),
        copy_ngram=EngineConfig.copy_ngram if getattr(args, "copy_ngram", None) is None
        else args.copy_ngram,
        shared_lookup_tokens=getattr(args, "shared_lookup_tokens", EngineConfig.shared_lookup_tokens),
        corpus_tokens=getattr(args, "corpus_tokens", EngineConfig.corpus_tokens),
        copy_guesses=getattr(args, "copy_guesses", None),
    )
