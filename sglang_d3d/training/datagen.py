"""`d3d datagen`: the target answers training prompts; the answers are the drafter's labels.

Two generators: a serving engine (`--server URL`: SGLang, vLLM or `d3d serve`, many requests in
flight, datagen_async.py), or, by default, the embedded engine on `--device` (continuous
batching on the engine's own target runner, training/generation.py). The prompts are the
user's files (`--prompts`) or the built-in GSM8K/mix order (datagen_prompts.py).

Shard k always holds records [k*S, (k+1)*S) of that deterministic order. A restart skips shards
already listed and, with a server, the records already journaled, so a stopped run resumes
where it stopped and never stores a record twice. Greedy responses (temperature 0) are exactly
the target's greedy continuation, which is what lets training measure greedy acceptance length
offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sglang_d3d.models.architectures import UnsupportedArchitectureError
from sglang_d3d.training.datagen_async import (
    ServerRun,
    resume_state,
    run_server_datagen,
    template_kwargs,
)
from sglang_d3d.training.datagen_embedded import eos_ids_of, run_embedded
from sglang_d3d.training.datagen_prompts import (  # noqa: F401 - interleave: re-exported
    PromptList,
    build_prompt_list,
    gsm8k_train_path,
    interleave,
)
from sglang_d3d.training.datagen_server import ServerError, TokenIdMode
from sglang_d3d.training.prompt_files import PromptFileError
from sglang_d3d.training.shards import read_manifest, write_manifest
from sglang_d3d.training.tokenizer_check import TokenizerMismatch

EMBEDDED_MAX_NEW, SERVER_MAX_NEW = 256, 2048


class DatagenError(ValueError):
    """A run that cannot start or go on; one line for the user."""


@dataclass(frozen=True)
class DatagenConfig:
    out_dir: str = "data/distill"
    target_path: str | None = None  # None: the default SmolLM2-135M-Instruct
    prompt_files: tuple[str, ...] = ()  # the user's JSONL files; () = the GSM8K/mix default
    gsm8k_path: str | None = None  # None: $D3D_DATASETS/gsm8k/train.jsonl if there, else mix only
    gsm8k_per_mix: int = 2  # GSM8K prompts per mix prompt in the interleaved order
    max_prompts: int | None = None  # cap on the prompt list (None: all)
    shard_size: int = 128
    max_new_tokens: int | None = None  # None: 2048 with a server, 256 embedded
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    max_shards: int | None = None  # stop after writing this many new shards (None: all)
    # JSON object passed to the target's chat template, e.g. '{"enable_thinking": false}' for
    # Qwen3 with thinking off; None: the template's own defaults
    chat_template_kwargs: str | None = None
    # the embedded engine
    batch_size: int = 32  # concurrent sequences (cache slots) of continuous batching
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    # a serving engine
    server: str | None = None  # base URL; None: the embedded engine
    server_model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    concurrency: int = 8
    token_ids: str = "auto"  # TokenIdMode
    retries: int = 2  # per request, by the openai client, before the run stops
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if min(self.shard_size, self.batch_size, self.concurrency) < 1:
            raise ValueError("shard_size, batch_size and concurrency must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        TokenIdMode(self.token_ids)
        template_kwargs(self.chat_template_kwargs)  # a bad one fails before anything runs

    @property
    def resolved_max_new(self) -> int:
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        # a CPU's answers stay short (hours per million tokens); servers and GPUs write long ones
        long = self.server or not str(self.device).startswith("cpu")
        return SERVER_MAX_NEW if long else EMBEDDED_MAX_NEW

    def server_run(self) -> ServerRun:
        return ServerRun(self.server, self.server_model, self.api_key, TokenIdMode(self.token_ids),
                         self.concurrency, self.retries, self.request_timeout,
                         self.resolved_max_new, self.temperature, self.seed, self.shard_size,
                         self.max_shards, template_kwargs=self.chat_template_kwargs)


# ---- manifest ---------------------------------------------------------------------------------
# Settings that change which sample lands in which shard; the others (batch size, concurrency,
# server address, caps) may differ between a run and its resumption.
CONTENT_KEYS = ("target_path", "gsm8k_per_mix", "shard_size", "max_new_tokens", "temperature",
                "seed", "chat_template_kwargs")
PRIVATE_KEYS = ("out_dir", "max_shards", "api_key")
# Settings of one generator only: a run records those of the one it used (a server run's
# engine settings are the server's own, in the manifest's "server").
EMBEDDED_KEYS = ("batch_size", "threads", "device", "dtype")
SERVER_KEYS = ("server", "server_model", "concurrency", "token_ids", "retries", "request_timeout")


def base_manifest(cfg: DatagenConfig, target: Path, prompts: PromptList) -> dict:
    other = EMBEDDED_KEYS if cfg.server else SERVER_KEYS
    generation = {k: v for k, v in asdict(cfg).items() if k not in PRIVATE_KEYS + other}
    generation.update(max_new_tokens=cfg.resolved_max_new, prompt_files=list(cfg.prompt_files),
                      prompts_sha256=prompts.fingerprint())
    return {
        "target": str(target.name),
        "prompts_source": prompts.sources,
        "prompt_lines_skipped": prompts.skipped,
        "num_prompts_planned": len(prompts.items),
        "generator": (f"server {cfg.server}" if cfg.server else
                      f"sglang_d3d TargetRunner, {cfg.dtype}, continuous batching on {cfg.device}"),
        "generation": generation,
        "shards": [],
        "num_samples": 0,
        "num_prompt_tokens": 0,
        "num_response_tokens": 0,
        "seconds": 0.0,
    }


def check_compatible(old: dict, new: dict, out: Path) -> None:
    """Refuse to add to a folder whose shards or journals came from another prompt list or
    other generation settings."""
    if not (old.get("shards") or any(out.glob("shard_*.partial.jsonl"))):
        return
    g_old, g_new = old.get("generation", {}), new["generation"]
    same = all(g_old.get(k) == g_new.get(k) for k in CONTENT_KEYS)
    if "prompts_sha256" in g_old:
        same = same and g_old["prompts_sha256"] == g_new["prompts_sha256"]
    else:  # folders made before the prompt list had a fingerprint: GSM8K/mix, by size
        same = (same and not g_new["prompt_files"]
                and bool(g_old.get("gsm8k_path")) == bool(g_new.get("gsm8k_path"))
                and old.get("num_prompts_planned") == new["num_prompts_planned"])
    if not same:
        raise DatagenError(f"{out} holds shards made with other settings or prompts; "
                           "use another --out-dir")


def open_manifest(cfg: DatagenConfig, target: Path, prompts: PromptList) -> dict:
    new = base_manifest(cfg, target, prompts)
    old = read_manifest(Path(cfg.out_dir))
    check_compatible(old, new, Path(cfg.out_dir))
    return {**old, "generation": new["generation"], "generator": new["generator"]} if old else new


# ---- both ---------------------------------------------------------------------------------------
def run_datagen_config(cfg: DatagenConfig) -> dict:
    """Generate every missing shard; returns the final manifest. Raises DatagenError,
    PromptFileError, ServerError or TokenizerMismatch with a one-line message."""
    from sglang_d3d.models.architectures import check_config_file
    from sglang_d3d.models.loading import load_tokenizer, resolve_target_path

    cfg = replace(cfg, gsm8k_path=gsm8k_train_path(cfg.gsm8k_path) if not cfg.prompt_files else None)
    target = resolve_target_path(cfg.target_path)
    check_config_file(target)  # an unsupported family is refused before anything is written
    prompts = build_prompt_list(cfg.prompt_files, cfg.gsm8k_path, cfg.gsm8k_per_mix, cfg.seed,
                                cfg.max_prompts)
    for name, n in prompts.skipped.items():
        if n:
            print(f"{name}: {n} line(s) skipped (not JSON, no user turn, or roles "
                  "a chat template may not take: tools, functions)", file=sys.stderr, flush=True)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = open_manifest(cfg, target, prompts)
    write_manifest(out, manifest)
    tok = load_tokenizer(target)
    prog = resume_state(out, manifest, cfg.shard_size, len(prompts.items))
    if cfg.server is None:
        run_embedded(cfg, target, tok, prompts, prog)
        return prog.manifest
    eos = eos_ids_of(_generation_config(target), tok)
    try:
        run = replace(cfg.server_run(), vocab_size=vocab_size(target, tok))
        facts = asyncio.run(run_server_datagen(run, tok, prompts, prog, eos))
    except ServerError as e:
        kept = prog.manifest.get("num_records", 0) + sum(len(p) for p in prog.pending.values())
        raise ServerError(f"{e}; the {kept} records done are kept in {out}: run the same "
                          "command again to resume") from e
    prog.manifest["server"] = facts
    write_manifest(out, prog.manifest)
    return prog.manifest


def vocab_size(target: Path, tok) -> int:
    """Ids the target can produce: its embedding rows (often padded past the tokenizer)."""
    cfg = json.loads((target / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return max(len(tok), int(cfg.get("vocab_size") or 0))


def _generation_config(target: Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(target))
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


def add_datagen_args(p: argparse.ArgumentParser) -> None:
    d = DatagenConfig()
    p.add_argument("--out-dir", default=d.out_dir,
                   help="folder of shards, journals and manifest.json; rerun to resume")
    p.add_argument("--target", dest="target_path", default=None,
                   help="HF folder of the target: its tokenizer and chat template (default: SmolLM2)")
    p.add_argument("--prompts", dest="prompt_files", action="append", default=[], metavar="FILE",
                   help="JSONL of ShareGPT `conversations`, OpenAI `messages` or `prompt` "
                        "(repeatable; default: GSM8K train and the built-in mix)")
    p.add_argument("--gsm8k-path", default=None,
                   help="GSM8K train JSONL (default: $D3D_DATASETS/gsm8k/train.jsonl if present)")
    p.add_argument("--gsm8k-per-mix", type=int, default=d.gsm8k_per_mix,
                   help="GSM8K questions per built-in mix prompt in the default order")
    p.add_argument("--max-prompts", type=int, default=None,
                   help="use only the first N records of the prompt list (default: all)")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="records per shard")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"per answer (default: {SERVER_MAX_NEW} with --server or on a GPU, "
                        f"{EMBEDDED_MAX_NEW} on a CPU)")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="0: greedy, the target's own continuation (what acceptance measures)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="order of the built-in mix; sampling seed of record i is seed + i")
    p.add_argument("--max-shards", type=int, default=None,
                   help="stop after this many new shards (default: all)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object for the target's chat template, as the server applies "
                        "it when serving: '{\"enable_thinking\": false}' answers Qwen3 with "
                        "thinking off (default: the template's own, thinking on for Qwen3)")
    e = p.add_argument_group("embedded engine (no --server)")
    e.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="sequences in flight (cache slots of continuous batching)")
    e.add_argument("--threads", type=int, default=d.threads, help="CPU threads of the target")
    e.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    e.add_argument("--dtype", default=d.dtype,
                   help="float32, bfloat16, or auto: bf16 on GPUs and CPUs with bf16 matrix "
                        "units, else fp32")
    s = p.add_argument_group("serving engine")
    s.add_argument("--server", default=None, help="base URL of an OpenAI-compatible server")
    s.add_argument("--server-model", default=None, help="model name (default: the first listed)")
    s.add_argument("--api-key", default=None, help="the server's key, if it asks for one (default: $OPENAI_API_KEY)")
    s.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    s.add_argument("--token-ids", default=d.token_ids, choices=[m.value for m in TokenIdMode],
                   help="how answers' token ids come back (default: the first the server offers)")
    s.add_argument("--retries", type=int, default=d.retries,
                   help="retries of a failed request before the run stops (it resumes when rerun)")
    s.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds one request may take")


USER_ERRORS = (DatagenError, PromptFileError, ServerError, TokenizerMismatch, FileNotFoundError,
               UnsupportedArchitectureError)


def run_datagen(args: argparse.Namespace) -> int:
    fields = DatagenConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["prompt_files"] = tuple(values.get("prompt_files") or ())
    try:
        cfg = DatagenConfig(**values)
    except ValueError as e:
        print(f"d3d datagen: {e}", file=sys.stderr)
        return 2
    try:
        m = run_datagen_config(cfg)
    except USER_ERRORS as e:
        print(f"d3d datagen: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"d3d datagen: stopped; run the same command again to resume ({cfg.out_dir})",
              file=sys.stderr)
        return 130
    rt = m.get("retokenized", {})
    print(f"{m['num_samples']} samples, {m['num_response_tokens']} response tokens "
          f"in {len(m['shards'])} shards under {cfg.out_dir}"
          + (f"; {rt['round_trip_mismatches']} of {rt['turns']} re-tokenized answers failed the "
             "round trip" if rt.get("turns") else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d datagen", description=__doc__.splitlines()[0])
    add_datagen_args(parser)
    return run_datagen(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
