"""`d3d datagen` without a server: the embedded engine answers, on `--device`.

A shard's records are generated together, turn by turn: turn t of every conversation in one
continuous batch (training/generation.py), after turn t-1 of all of them. The shard is written
whole, then listed in the manifest, so a stopped run loses at most the shard in progress.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_d3d.training.datagen_async import Progress, encode_chat, record_shard
from sglang_d3d.training.datagen_journal import Record, Turn, pack_shard
from sglang_d3d.training.datagen_prompts import PromptList
from sglang_d3d.training.generation import generate_continuous
from sglang_d3d.training.shards import shard_name, write_manifest

if TYPE_CHECKING:
    from sglang_d3d.training.datagen import DatagenConfig


def generate_shard(target, tok, items, first_index: int, cfg: DatagenConfig, eos_ids,
                   pbar=None) -> list[Record]:
    """Records for `items` (absolute indices from first_index): turn t of every conversation
    is generated in one continuous batch, after turn t-1 of all of them."""
    answers: list[list[str]] = [[] for _ in items]
    turns: list[list[Turn]] = [[] for _ in items]
    for t in range(max(len(c.user_turns) for _, c in items)):
        active = [j for j, (_, c) in enumerate(items) if t < len(c.user_turns)]
        prompts = [encode_chat(tok, items[j][1].messages(answers[j]), cfg.chat_template_kwargs)
                   for j in active]
        results = generate_continuous(
            target, prompts, cfg.resolved_max_new, eos_ids, num_slots=cfg.batch_size,
            temperature=cfg.temperature, seed=cfg.seed + first_index + t * 1_000_003,
            on_done=(lambda _: pbar.update(1)) if pbar is not None else None, device=cfg.device,
        )  # fmt: skip
        for j, prompt, (ids, finished) in zip(active, prompts, results, strict=True):
            turns[j].append(Turn(prompt, list(ids), finished))
            answers[j].append(tok.decode(ids, skip_special_tokens=True))
    return [Record(first_index + j, items[j][0], tuple(turns[j])) for j in range(len(items))]


def eos_ids_of(gen, tok) -> list[int]:
    """The target's end ids (generation config `gen`, may be None, then the tokenizer's), the
    generation config's first: it is appended to finished answers a server returned without it."""
    eos = getattr(gen, "eos_token_id", None)
    ids = list(eos if isinstance(eos, list) else [eos]) if eos is not None else []
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def run_embedded(cfg: DatagenConfig, target: Path, tok, prompts: PromptList, prog: Progress) -> None:
    import torch
    from tqdm import tqdm

    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.loading import load_hf_model, resolve_dtype

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    dtype = str(resolve_dtype(cfg.dtype, cfg.device)).removeprefix("torch.")
    model = load_hf_model(target, dtype).to(cfg.device)
    eos = eos_ids_of(model.generation_config, tok)
    decoder = Decoder.from_hf(model)
    s, items = cfg.shard_size, prompts.items
    todo = [k for k in range(-(-len(items) // s)) if shard_name(k) not in prog.manifest["shards"]]
    todo = todo[: cfg.max_shards] if cfg.max_shards is not None else todo
    total = sum(sum(len(c.user_turns) for _, c in items[k * s : (k + 1) * s]) for k in todo)
    pbar = tqdm(total=total, desc="datagen", unit="turn", mininterval=10)
    for k in todo:
        t0 = time.perf_counter()
        records = generate_shard(decoder, tok, items[k * s : (k + 1) * s], k * s, cfg, set(eos), pbar)
        samples = pack_shard(prog.out, k, records)
        record_shard(prog.manifest, shard_name(k), samples, records, time.perf_counter() - t0)
        write_manifest(prog.out, prog.manifest)  # after the shard: a listed shard exists whole
    pbar.close()
