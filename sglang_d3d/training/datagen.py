"""`d3d datagen`: the target answers training prompts; the answers are the drafter's labels.

Prompt order: GSM8K train questions and the instruction/code mix interleaved (ratio
`gsm8k_per_mix`), so any prefix of a run is a usable, mixed dataset. Shard k always holds prompts
[k*S, (k+1)*S) of that deterministic order; a restart skips shards already on disk, so a killed
run resumes where it stopped and never writes a prompt twice. Generation is continuously
batched on the engine's own target runner (training/generation.py).

Greedy responses (temperature 0) are exactly the target's greedy continuation, which is what
lets training measure greedy acceptance length offline.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sglang_d3d.training.generation import generate_continuous
from sglang_d3d.training.prompt_mix import build_mix
from sglang_d3d.training.shards import (
    Sample,
    read_manifest,
    shard_name,
    write_manifest,
    write_shard,
)

GSM8K_TRAIN = "/work/shared/datasets/gsm8k/train.jsonl"
SOURCE_GSM8K, SOURCE_MIX = 0, 1


@dataclass(frozen=True)
class DatagenConfig:
    out_dir: str = "data/distill"
    target_path: str | None = None  # None: the default SmolLM2-135M-Instruct
    gsm8k_path: str = GSM8K_TRAIN
    gsm8k_per_mix: int = 2  # GSM8K prompts per mix prompt in the interleaved order
    max_prompts: int | None = None  # cap on the prompt list (None: all)
    shard_size: int = 128
    batch_size: int = 32  # concurrent sequences (cache slots) of continuous batching
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    threads: int = 1
    max_shards: int | None = None  # stop after writing this many new shards (None: all)

    def __post_init__(self) -> None:
        if self.shard_size < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("shard_size, batch_size and max_new_tokens must be >= 1")


def load_gsm8k_questions(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def interleave(a: list, b: list, a_per_b: int) -> list[tuple[int, object]]:
    """[(0, a0), (0, a1), (1, b0), ...]: `a_per_b` items of a, then one of b, until both run out."""
    out, ia, ib = [], 0, 0
    while ia < len(a) or ib < len(b):
        for _ in range(a_per_b):
            if ia < len(a):
                out.append((0, a[ia]))
                ia += 1
        if ib < len(b):
            out.append((1, b[ib]))
            ib += 1
    return out


def build_prompt_list(cfg: DatagenConfig) -> list[tuple[int, str]]:
    """(source, question text) in the deterministic order shards are cut from."""
    gsm = load_gsm8k_questions(cfg.gsm8k_path) if cfg.gsm8k_path else []
    items = interleave(gsm, build_mix(cfg.seed), cfg.gsm8k_per_mix)
    return items[: cfg.max_prompts] if cfg.max_prompts else items


def encode_chat(tokenizer, question: str) -> list[int]:
    """The target's chat template with the assistant turn opened, as the engine's clients use it."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_shard(target, tok, items, first_index: int, cfg: DatagenConfig, eos_ids, pbar=None):
    """Samples for prompts `items` (absolute indices from first_index)."""
    encoded = [encode_chat(tok, q) for _, q in items]
    results = generate_continuous(
        target, encoded, cfg.max_new_tokens, eos_ids, num_slots=cfg.batch_size,
        temperature=cfg.temperature, seed=cfg.seed + first_index,
        on_done=(lambda _: pbar.update(1)) if pbar is not None else None,
    )
    samples = [
        Sample(np.array(encoded[i]), np.array(results[i][0]), items[i][0], first_index + i)
        for i in range(len(items))
    ]
    return samples, [r[1] for r in results]


def _eos_ids(model, tok) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    return ids | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def _base_manifest(cfg: DatagenConfig, target: Path, num_prompts: int) -> dict:
    return {
        "target": str(target.name),
        "prompts_source": {"gsm8k_train": cfg.gsm8k_path, "mix": "sglang_d3d.training.prompt_mix"},
        "num_prompts_planned": num_prompts,
        "generator": "sglang_d3d TargetRunner, float32, continuous batching (training/generation.py)",
        "generation": {k: v for k, v in asdict(cfg).items() if k not in ("out_dir", "max_shards")},
        "shards": [],
        "num_samples": 0,
        "num_prompt_tokens": 0,
        "num_response_tokens": 0,
        "seconds": 0.0,
    }


def _record_shard(manifest: dict, name: str, samples: list[Sample], seconds: float) -> None:
    manifest["shards"].append(name)
    manifest["num_samples"] += len(samples)
    manifest["num_prompt_tokens"] += int(sum(len(s.prompt) for s in samples))
    manifest["num_response_tokens"] += int(sum(len(s.response) for s in samples))
    manifest["seconds"] = round(manifest["seconds"] + seconds, 1)


# Settings that change which sample lands in which shard; the others (batch size, threads, caps)
# may differ between a run and its resumption.
CONTENT_KEYS = ("target_path", "gsm8k_path", "gsm8k_per_mix", "shard_size", "max_new_tokens",
                "temperature", "seed")


def _check_compatible(old: dict, new: dict) -> None:
    def key(m: dict) -> dict:
        return {k: m.get("generation", {}).get(k) for k in CONTENT_KEYS}

    if old and key(old) != key(new):
        raise ValueError(
            "the output folder holds shards made with other settings; use another --out-dir"
        )


def run_datagen_config(cfg: DatagenConfig) -> dict:
    """Generate every missing shard; returns the final manifest."""
    import torch
    from tqdm import tqdm

    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.loading import load_hf_model, load_tokenizer, resolve_target_path

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_target_path(cfg.target_path)
    items = build_prompt_list(cfg)
    manifest = _base_manifest(cfg, target, len(items))
    old = read_manifest(out)
    _check_compatible(old, manifest)
    manifest = {**old, "generation": manifest["generation"]} if old else manifest
    model, tok = load_hf_model(target), load_tokenizer(target)
    eos_ids = _eos_ids(model, tok)
    decoder = Decoder.from_hf(model)
    num_shards = -(-len(items) // cfg.shard_size)
    todo = [k for k in range(num_shards) if shard_name(k) not in manifest["shards"]]
    todo = todo[: cfg.max_shards] if cfg.max_shards is not None else todo
    pbar = tqdm(total=sum(len(items[k * cfg.shard_size : (k + 1) * cfg.shard_size]) for k in todo),
                desc="datagen", unit="prompt", mininterval=10)
    for k in todo:
        t0 = time.perf_counter()
        chunk = items[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        samples, finished = generate_shard(decoder, tok, chunk, k * cfg.shard_size, cfg, eos_ids, pbar)
        write_shard(out / shard_name(k), samples, finished)
        _record_shard(manifest, shard_name(k), samples, time.perf_counter() - t0)
        write_manifest(out, manifest)  # after the shard: a listed shard always exists whole
    pbar.close()
    return manifest


def add_datagen_args(p: argparse.ArgumentParser) -> None:
    d = DatagenConfig()
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--target", dest="target_path", default=None, help="HF folder (default: SmolLM2)")
    p.add_argument("--gsm8k-path", default=d.gsm8k_path)
    p.add_argument("--gsm8k-per-mix", type=int, default=d.gsm8k_per_mix)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--shard-size", type=int, default=d.shard_size)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--max-shards", type=int, default=None)


def run_datagen(args: argparse.Namespace) -> int:
    fields = DatagenConfig.__dataclass_fields__
    cfg = DatagenConfig(**{k: v for k, v in vars(args).items() if k in fields})
    m = run_datagen_config(cfg)
    print(f"{m['num_samples']} samples, {m['num_response_tokens']} response tokens "
          f"in {len(m['shards'])} shards under {cfg.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d datagen", description=__doc__.splitlines()[0])
    add_datagen_args(parser)
    return run_datagen(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
