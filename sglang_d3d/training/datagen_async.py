"""`d3d datagen --server URL`: many requests in flight, records journaled as they complete.

`concurrency` workers pull record indices in order from one shared iterator. A record is one
conversation: its assistant turns are generated one after another, each prompted with the
target's own earlier answers. A finished record goes to its shard's journal at once
(datagen_journal.py); a shard whose records are all in is packed and listed in the manifest.
A server error (after the client's retries) stops every worker: the journaled records stay,
the in-flight ones are dropped, and the same command resumes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_d3d.training.datagen_journal import (
    Record,
    Turn,
    append_record,
    journal_path,
    pack_shard,
    read_journal,
)
from sglang_d3d.training.datagen_prompts import PromptList
from sglang_d3d.training.datagen_server import Reply, ServerClient, ServerError, TokenIdMode
from sglang_d3d.training.prompt_files import Conversation
from sglang_d3d.training.shards import Sample, shard_name, write_manifest
from sglang_d3d.training.tokenizer_check import check_tokenizer


@dataclass(frozen=True)
class ServerRun:
    """What a server run needs besides the prompt list (a view of DatagenConfig)."""

    url: str
    model: str | None
    api_key: str | None
    token_ids: TokenIdMode
    concurrency: int
    retries: int
    timeout: float
    max_new_tokens: int
    temperature: float
    seed: int
    shard_size: int
    max_shards: int | None
    vocab_size: int | None = None  # the target's; a returned id at or above it is refused
    template_kwargs: str | None = None  # JSON for the chat template (DatagenConfig)


@dataclass
class Progress:
    """The run's books: which records are in which unfinished shard, and the manifest."""

    out: Path
    manifest: dict
    shard_size: int
    num_records: int
    pending: dict[int, dict[int, Record]] = field(default_factory=dict)
    last_write: float = field(default_factory=time.perf_counter)
    new_tokens: int = 0

    def shard_len(self, k: int) -> int:
        return min(self.shard_size, self.num_records - k * self.shard_size)

    def add(self, rec: Record) -> None:
        k = rec.index // self.shard_size
        append_record(journal_path(self.out, k), rec)
        self.pending.setdefault(k, {})[rec.index] = rec
        self.new_tokens += sum(len(t.response) for t in rec.turns)
        if len(self.pending[k]) == self.shard_len(k):
            self.finish_shard(k)

    def finish_shard(self, k: int) -> None:
        records = list(self.pending.pop(k).values())
        samples = pack_shard(self.out, k, records)
        now = time.perf_counter()
        record_shard(self.manifest, shard_name(k), samples, records, now - self.last_write)
        self.last_write = now
        write_manifest(self.out, self.manifest)
        journal_path(self.out, k).unlink(missing_ok=True)  # only once the manifest lists it


def record_shard(manifest: dict, name: str, samples: list[Sample], records: list[Record],
                 seconds: float) -> None:
    manifest["shards"] = sorted({*manifest["shards"], name})
    manifest["num_records"] = manifest.get("num_records", 0) + len(records)
    manifest["num_samples"] += len(samples)
    manifest["num_prompt_tokens"] += int(sum(len(s.prompt) for s in samples))
    manifest["num_response_tokens"] += int(sum(len(s.response) for s in samples))
    manifest["seconds"] = round(manifest["seconds"] + seconds, 1)
    rt = manifest.setdefault("retokenized", {"turns": 0, "round_trip_mismatches": 0})
    rt["turns"] += sum(r.retokenized for r in records)
    rt["round_trip_mismatches"] += sum(r.mismatches for r in records)


def resume_state(out: Path, manifest: dict, shard_size: int, num_records: int) -> Progress:
    """Journals of unlisted shards read back; journals of listed shards (a kill between listing
    and deleting) dropped; shards whose journal is whole packed now."""
    prog = Progress(out, manifest, shard_size, num_records)
    num_shards = -(-num_records // shard_size)
    for k in range(num_shards):
        path = journal_path(out, k)
        if shard_name(k) in manifest["shards"]:
            path.unlink(missing_ok=True)
            continue
        recs = read_journal(path)
        if recs:
            prog.pending[k] = recs
            if len(recs) == prog.shard_len(k):
                prog.finish_shard(k)
    return prog


def todo_indices(prog: Progress, max_shards: int | None) -> list[int]:
    num_shards = -(-prog.num_records // prog.shard_size)
    shards = [k for k in range(num_shards) if shard_name(k) not in prog.manifest["shards"]]
    shards = shards[:max_shards] if max_shards is not None else shards
    out = []
    for k in shards:
        done = prog.pending.get(k, {})
        start = k * prog.shard_size
        out += [i for i in range(start, start + prog.shard_len(k)) if i not in done]
    return out


def template_kwargs(raw: str | None) -> dict:
    """--chat-template-kwargs as a dict; ValueError unless it is a JSON object."""
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object, such as "
                         '\'{"enable_thinking": false}\'')
    return value


def encode_chat(tok, messages: list[dict], kwargs: str | None = None) -> list[int]:
    """The target's chat template with the assistant turn opened, as the engine's clients use
    it; `kwargs`: --chat-template-kwargs (Qwen3's enable_thinking, for one)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   **template_kwargs(kwargs))
    return tok(text, add_special_tokens=False)["input_ids"]


def response_ids(reply: Reply, tok, eos_ids: list[int]) -> tuple[list[int], int, int]:
    """(ids, retokenized 0/1, round-trip mismatch 0/1). A finished answer ends with EOS, as the
    embedded engine's do, whether or not the server's ids include it."""
    retok = mismatch = 0
    ids = reply.token_ids
    if ids is None:
        ids = tok(reply.text, add_special_tokens=False)["input_ids"]
        retok = 1
        mismatch = int(tok.decode(ids) != reply.text)
    ids = list(ids)
    if reply.finished and eos_ids and (not ids or ids[-1] not in eos_ids):
        ids.append(eos_ids[0])
    return ids, retok, mismatch


def check_vocabulary(ids: list[int], vocab_size: int | None) -> None:
    """A server with a larger vocabulary can pass the tokenizer probes (it accepts every id
    the target has) and still answer with ids the target lacks: refuse before storing them."""
    if vocab_size is None:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ServerError(f"the server returned token id {bad[0]}, outside the target's "
                          f"vocabulary of {vocab_size}: it serves another model or tokenizer")


async def answer_record(client: ServerClient, tok, run: ServerRun, eos_ids: list[int],
                        index: int, source: int, conv: Conversation) -> Record:
    answers: list[str] = []
    turns, retok, mismatches = [], 0, 0
    for _ in conv.user_turns:
        prompt = encode_chat(tok, conv.messages(answers), run.template_kwargs)
        budget = run.max_new_tokens
        if client.max_model_len:
            budget = min(budget, client.max_model_len - len(prompt))
        if budget < 1:
            break  # the conversation no longer fits the server's context: its later turns dropped
        reply = await client.complete(prompt, budget, run.temperature, run.seed + index)
        if run.token_ids in (TokenIdMode.COMPLETIONS, TokenIdMode.GENERATE) and reply.token_ids is None:
            raise ServerError(f"the server returned no token ids ({run.token_ids.value}); "
                              "use --token-ids auto or text")
        ids, r, m = response_ids(reply, tok, eos_ids)
        check_vocabulary(ids, run.vocab_size)
        turns.append(Turn(prompt, ids, reply.finished))
        retok, mismatches = retok + r, mismatches + m
        answers.append(reply.text)
    return Record(index, source, tuple(turns), retok, mismatches)


async def connect(run: ServerRun, tok) -> ServerClient:
    """Open the client, pick how token ids come back, and check the tokenizer."""
    client = ServerClient(run.url, run.api_key, run.retries, run.timeout)
    try:
        await client.open(run.model)
        probe = tok("Hello")["input_ids"] or [0]
        mode = run.token_ids
        if mode is TokenIdMode.AUTO:
            mode = await client.detect_mode(probe)
        client.mode = mode
        await check_tokenizer(client, tok)
    except BaseException:
        await client.close()
        raise
    return client


async def drive(client: ServerClient, tok, run: ServerRun, prompts: PromptList, prog: Progress,
                todo: list[int], eos_ids: list[int]) -> None:
    """Answer every record in `todo` with `run.concurrency` requests in flight."""
    from tqdm import tqdm

    pbar = tqdm(total=len(todo), desc="datagen", unit="rec", mininterval=1.0)
    start, indices = time.perf_counter(), iter(todo)

    async def worker() -> None:
        for i in indices:  # one iterator shared by all workers: each index is taken once
            source, conv = prompts.items[i]
            prog.add(await answer_record(client, tok, run, eos_ids, i, source, conv))
            pbar.update(1)
            pbar.set_postfix_str(f"{prog.new_tokens / (time.perf_counter() - start):.1f} tok/s",
                                 refresh=False)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(run.concurrency, len(todo)))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pbar.close()


async def run_server_datagen(run: ServerRun, tok, prompts: PromptList, prog: Progress,
                             eos_ids: list[int]) -> dict:
    """Generate every missing record; returns facts about the server for the manifest."""
    client = await connect(run, tok)
    facts = {"url": client.root, "model": client.model, "token_ids": client.mode.value,
             "max_model_len": client.max_model_len}
    prog.manifest["server"] = facts  # written with the first shard
    prog.last_write = time.perf_counter()  # the probes are not generation time
    try:
        todo = todo_indices(prog, run.max_shards)
        await drive(client, tok, run, prompts, prog, todo, eos_ids)
    finally:
        await client.close()
    return facts
