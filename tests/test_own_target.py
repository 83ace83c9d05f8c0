"""A drafter for the user's own target: `d3d datagen --server` against a real `d3d serve` on a
tiny random Qwen2-shaped target whose vocabulary exceeds uint16, the user's prompt files
(multi-turn included), resume after a kill or a failing server, the whole path from a served
target through torchrun training to a served drafter, and the refusals (each one line).
Two processes against one at the same global batch: tests/test_train_distributed.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sglang_d3d.testing import LARGE_VOCAB, make_tiny_target, tiny_tokenizer
from sglang_d3d.training.datagen import add_datagen_args, run_datagen
from sglang_d3d.training.datagen_journal import Record, Turn, append_record, read_journal
from sglang_d3d.training.prompt_files import PromptFileError, read_prompt_file
from sglang_d3d.training.shards import (
    Sample,
    load_samples,
    open_shards,
    read_manifest,
    read_shard,
    shard_name,
    write_manifest,
    write_shard,
)

ROOT = Path(__file__).resolve().parents[1]
HIGH = LARGE_VOCAB - 7  # a word whose id needs more than 16 bits

CHATS = [
    {"prompt": f"w5 w9 w{HIGH}"},
    {"conversations": [{"from": "system", "value": "w11 w12"},
                       {"from": "human", "value": "w20 w21 w22"},
                       {"from": "gpt", "value": "w99 w98 (replaced by the target's answer)"},
                       {"from": "human", "value": f"w30 w{HIGH - 1}"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}]}]},
    {"conversations": [{"from": "gpt", "value": "an answer with no question"}]},  # skipped
    {"prompt": "w50 w51 w52 w53"},
    {"messages": [{"role": "user", "content": "w60"}, {"role": "assistant", "content": "w61"},
                  {"role": "user", "content": "w62 w63"}, {"role": "assistant", "content": "w64"}]},
]


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _datagen(argv: list[str], capsys=None) -> tuple[int, str]:
    import argparse

    p = argparse.ArgumentParser()
    add_datagen_args(p)
    rc = run_datagen(p.parse_args(argv))
    err = capsys.readouterr().err if capsys is not None else ""
    return rc, err


def _rows(folder: Path) -> list[tuple]:
    return [(s.prompt_index, s.turn, s.source, s.prompt.tolist(), s.response.tolist())
            for s in load_samples(folder)]


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("d3d datagen:")]
    assert len(lines) == 1, err
    return lines[0]


# ---- prompt files, journal, shards: no server ------------------------------------------------
def test_prompt_files_take_sharegpt_openai_and_plain_and_skip_the_rest(tmp_path):
    pf = read_prompt_file(_write_jsonl(tmp_path / "c.jsonl", CHATS))
    assert pf.num_skipped == 1 and len(pf.conversations) == 5
    multi = pf.conversations[1]
    assert multi.system == "w11 w12" and multi.user_turns == ("w20 w21 w22", f"w30 w{HIGH - 1}")
    # turn 2 is conditioned on the target's own first answer, never on the file's
    assert multi.messages(["MINE"]) == [
        {"role": "system", "content": "w11 w12"}, {"role": "user", "content": "w20 w21 w22"},
        {"role": "assistant", "content": "MINE"}, {"role": "user", "content": f"w30 w{HIGH - 1}"}]
    assert pf.conversations[2].user_turns == ("w40 w41",)
    assert pf.conversations[4].user_turns == ("w60", "w62 w63")


def test_mt_bench_turns_are_user_turns():
    from sglang_d3d.training.prompt_files import conversation_of

    assert conversation_of({"turns": ["w5", "w6 w7"]}).user_turns == ("w5", "w6 w7")
    assert conversation_of({"turns": []}) is None


def test_the_tokenizer_check_compares_text_as_a_server_detokenizes_it():
    from sglang_d3d.training.tokenizer_check import _same, decode_after

    assert _same("", "\ufffd")  # a partial UTF-8 character: held back by a server
    assert _same(" w5 w6", "w5 w6") and not _same("w5", "w6")
    tok = tiny_tokenizer()
    assert decode_after(tok, [5, 6], [7, 8]).split() == ["w7", "w8"]


def test_a_prompt_file_without_a_usable_turn_is_a_one_line_error(tmp_path, capsys):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "no known field"},
                                                {"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(PromptFileError, match="no usable turn"):
        read_prompt_file(bad)
    target = make_tiny_target(tmp_path / "t")
    rc, err = _datagen(["--target", target, "--prompts", bad, "--out-dir", str(tmp_path / "o")],
                       capsys)
    assert rc == 1 and "no usable turn in 2 line(s)" in _error_line(err)
    assert not list((tmp_path / "o").glob("shard_*"))


def test_a_server_that_is_down_is_a_one_line_error(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = make_tiny_target(tmp_path / "t")
    rc, err = _datagen(["--target", target, "--server", f"http://127.0.0.1:{port}",
                        "--retries", "0", "--out-dir", str(tmp_path / "o")], capsys)
    assert rc == 1 and f"cannot reach http://127.0.0.1:{port}" in _error_line(err)


def test_shards_hold_ids_above_uint16_and_old_uint16_shards_still_load(tmp_path):
    samples = [Sample(np.array([3, 70_001]), np.array([100_000 + i, 2]), 2, i, i % 2)
               for i in range(5)]
    write_shard(tmp_path / shard_name(0), samples[:3], [True] * 3)
    write_shard(tmp_path / shard_name(1), samples[3:], [False] * 2)
    write_manifest(tmp_path, {"shards": [shard_name(0), shard_name(1)]})
    lazy = open_shards(tmp_path, cache_shards=1)
    assert len(lazy) == 5 and lazy.lengths.tolist() == [4] * 5
    assert lazy.prompt_indices.tolist() == [0, 1, 2, 3, 4]
    assert lazy[4].response.tolist() == [100_004, 2] and lazy[-1].turn == 0 and lazy[1].turn == 1
    assert [s.prompt_index for s in lazy] == [0, 1, 2, 3, 4]
    old = tmp_path / "old.npz"  # the layout before uint32: uint16 tokens, no `turn`
    np.savez_compressed(old, tokens=np.array([5, 6, 7, 8], np.uint16),
                        prompt_len=np.array([2], np.int32), resp_len=np.array([2], np.int32),
                        prompt_index=np.array([9], np.int32), source=np.array([0], np.uint8),
                        finished=np.array([True]))
    (s,) = read_shard(old)
    assert s.prompt.tolist() == [5, 6] and s.response.tolist() == [7, 8] and s.turn == 0
    assert s.ids.dtype == np.int64


def test_a_journal_line_cut_by_a_kill_is_dropped_and_the_rest_kept(tmp_path):
    path = tmp_path / "shard_00000.partial.jsonl"
    for i in (0, 1):
        append_record(path, Record(i, 2, (Turn([1, 2], [3, 70_000], True),)))
    with open(path, "a") as f:
        f.write('{"index": 2, "source": 2, "tur')  # killed mid-write
    recs = read_journal(path)
    assert sorted(recs) == [0, 1] and recs[1].turns[0].response == [3, 70_000]
    assert len(path.read_text().splitlines()) == 2  # rewritten clean: appends stay parseable


def test_embedded_datagen_regenerates_every_turn_of_a_conversation(tmp_path):
    target = make_tiny_target(tmp_path / "t")
    chats = _write_jsonl(tmp_path / "c.jsonl", [
        {"conversations": [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7"},
                           {"from": "human", "value": "w8"}]},
        {"prompt": "w9 w10"}])
    rc, _ = _datagen(["--target", target, "--prompts", chats, "--out-dir", str(tmp_path / "o"),
                      "--max-new-tokens", "5", "--shard-size", "2"])
    assert rc == 0
    rows = _rows(tmp_path / "o")
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, 0, 2), (0, 1, 2), (1, 0, 2)]
    first_answer = [t for t in rows[0][4] if t != 2]  # without EOS
    assert _contains(rows[1][3], first_answer)  # turn 2's prompt holds the target's own answer


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


# ---- against a real `d3d serve` -----------------------------------------------------------------
class Faults:
    """Misbehaviour injected in front of the real server's routes."""

    def __init__(self) -> None:
        self.delay = 0.0  # seconds added to each completion
        self.fail_once_in: Path | None = None  # 500s once this folder holds a record

    def reset(self) -> None:
        self.delay, self.fail_once_in = 0.0, None

    def failing(self) -> bool:
        d = self.fail_once_in
        return d is not None and any(d.glob("shard_*"))


def _qwen2_pair(root: Path) -> tuple[str, str]:
    """A Qwen2-shaped target (q/k/v biases) with a 70,000-token vocabulary and its drafter.
    Untied, seed 3: a tied tiny head mostly repeats the last token, these answers vary."""
    from sglang_d3d.models.decoder import Decoder
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model
    from sglang_d3d.testing import tiny_hf_model

    target = root / "target"
    tiny_hf_model("qwen2", seed=3, vocab=LARGE_VOCAB, tied=False).save_pretrained(target)
    tiny_tokenizer(LARGE_VOCAB).save_pretrained(target)
    decoder = Decoder.from_hf(load_hf_model(target))
    D3DDrafter.init_from_target(decoder, [0, 3], 4, rank=4, alpha=4.0).save_pretrained(root / "d")
    return str(target), str(root / "d")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(target_dir, url, faults): a Qwen2-shaped target with a 70,000-token vocabulary."""
    import asyncio

    from sglang_d3d.server.app import create_app
    from sglang_d3d.server.testing import ServerThread, tiny_server_config
    from starlette.responses import JSONResponse

    pair = _qwen2_pair(tmp_path_factory.mktemp("own"))
    app = create_app(tiny_server_config(pair, max_batch_size=4))
    faults = Faults()

    @app.middleware("http")
    async def inject(request, call_next):
        if request.url.path == "/v1/completions":
            if faults.failing():
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            await asyncio.sleep(faults.delay)
        return await call_next(request)

    with ServerThread(app) as srv:
        yield pair[0], srv.url, faults


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> str:
    return _write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", CHATS)


def _server_args(served, chats: str, out: Path, *extra: str) -> list[str]:
    target, url, _ = served
    return ["--server", url, "--target", target, "--prompts", chats, "--out-dir", str(out),
            "--concurrency", "4", "--max-new-tokens", "8", "--shard-size", "2", "--retries", "0",
            *extra]


@pytest.fixture(scope="module")
def reference(served, chats, tmp_path_factory) -> list[tuple]:
    """An uninterrupted server run: the records every interrupted run must end with."""
    out = tmp_path_factory.mktemp("ref") / "data"
    rc, _ = _datagen(_server_args(served, chats, out))
    assert rc == 0
    return _rows(out)


@pytest.mark.slow
def test_datagen_from_d3d_serve_stores_the_ids_of_every_turn(served, reference):
    import torch

    from sglang_d3d.models.loading import load_hf_model

    rows = reference
    # 5 usable records, two of them with two user turns: 7 samples, in record then turn order
    assert [(r[0], r[1]) for r in rows] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0), (4, 1)]
    assert {r[2] for r in rows} == {2}
    assert max(max(r[3]) for r in rows) > 65_535  # the prompt's HIGH word, stored whole
    assert all(0 < len(r[4]) <= 8 + 1 for r in rows)  # + the EOS a finished answer ends with
    own = [t for t in rows[1][4] if t != 2]
    assert _contains(rows[2][3], own)  # the second turn is conditioned on the target's answer
    tok = tiny_tokenizer(LARGE_VOCAB)
    assert tok.decode(rows[0][3]).split()[-1] == "w3"  # the chat template's opened turn
    hf = load_hf_model(Path(served[0]), "float64")  # the server's dtype in these tests
    for _, _, _, prompt, response in rows[:3]:  # the target's own greedy tokens, exactly
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert response == ref


@pytest.mark.slow
def test_d3d_serve_returns_token_ids_only_when_asked(served):
    import httpx

    _, url, _ = served
    body = {"prompt": [5, 9, HIGH], "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True},
                     timeout=60).json()["choices"][0]
    assert "token_ids" not in plain and len(ids["token_ids"]) == 4
    assert tiny_tokenizer(LARGE_VOCAB).decode(ids["token_ids"]) == ids["text"].strip()
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]
    assert len(chat["token_ids"]) == 3


@pytest.mark.slow
def test_manifest_reports_the_server_and_token_id_mode(served, chats, tmp_path, capsys):
    out = tmp_path / "d"
    rc, err = _datagen(_server_args(served, chats, out, "--max-prompts", "2"), capsys)
    m = read_manifest(out)
    assert rc == 0 and m["server"]["token_ids"] == "completions"
    assert m["server"]["model"] == "tiny" and m["num_records"] == 2
    assert m["prompt_lines_skipped"] == {"chats.jsonl": 1}  # the answer with no question
    assert "chats.jsonl: 1 line(s) skipped (not JSON" in err  # said, not only recorded
    # the server's run records the server's settings, not the embedded engine's
    assert m["generation"]["concurrency"] == 4 and "batch_size" not in m["generation"]
    assert "dtype" not in m["generation"] and "threads" not in m["generation"]
    assert m["retokenized"] == {"turns": 0, "round_trip_mismatches": 0}
    assert not list(out.glob("*.partial.jsonl"))


@pytest.mark.slow
def test_text_only_mode_retokenizes_and_counts_round_trips(served, chats, reference, tmp_path):
    out = tmp_path / "t"
    rc, _ = _datagen(_server_args(served, chats, out, "--token-ids", "text"))
    m = read_manifest(out)
    assert rc == 0 and m["retokenized"]["turns"] == 7
    # the tiny word-level tokenizer drops whitespace: the answers' leading space does not come
    # back, and each answer is counted; the ids still equal the served ones
    assert m["retokenized"]["round_trip_mismatches"] == 7
    assert _rows(out) == reference


@pytest.mark.slow
def test_a_killed_run_resumes_with_nothing_lost_or_doubled(served, chats, reference, tmp_path):
    _, _, faults = served
    out = tmp_path / "k"
    faults.delay = 0.4  # a window to kill the run in, after its first record
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sglang_d3d.training.datagen",
                             *_server_args(served, chats, out, "--concurrency", "2")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("shard_*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        faults.reset()
        if proc.poll() is None:
            proc.kill()
    assert len(read_manifest(out).get("shards", [])) < 3  # it did stop mid-way
    rc, _ = _datagen(_server_args(served, chats, out))
    assert rc == 0 and _rows(out) == reference
    assert not list(out.glob("*.partial.jsonl"))


@pytest.mark.slow
def test_a_server_failing_mid_run_stops_it_and_the_rerun_resumes(served, chats, reference,
                                                                 tmp_path, capsys):
    _, _, faults = served
    out = tmp_path / "f"
    faults.fail_once_in = out
    try:
        rc, err = _datagen(_server_args(served, chats, out, "--concurrency", "1"), capsys)
    finally:
        faults.reset()
    line = _error_line(err)
    assert rc == 1 and "answered 500" in line and "run the same command again to resume" in line
    kept = sum(1 for _ in out.glob("shard_*.partial.jsonl")) + len(read_manifest(out)["shards"])
    assert kept >= 1
    rc, _ = _datagen(_server_args(served, chats, out))
    assert rc == 0 and _rows(out) == reference


def _other_tokenizer_target(served, tmp_path: Path, tok) -> str:
    folder = tmp_path / "other"
    shutil.copytree(served[0], folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    tok.save_pretrained(folder)
    return str(folder)


def _permuted_tokenizer(vocab: int):
    """The same words, numbered in reverse above the specials: same size, other ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": vocab + 2 - i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")
    fast.chat_template = tiny_tokenizer(8).chat_template
    return fast


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["larger_vocab", "permuted"])
def test_a_server_with_another_tokenizer_is_refused_in_one_line(served, chats, tmp_path, capsys,
                                                                kind):
    tok = tiny_tokenizer(LARGE_VOCAB + 100) if kind == "larger_vocab" else _permuted_tokenizer(LARGE_VOCAB)
    other = _other_tokenizer_target(served, tmp_path, tok)
    args = _server_args(served, chats, tmp_path / "o")
    args[args.index("--target") + 1] = other
    rc, err = _datagen(args, capsys)
    assert rc == 1 and "not the target's tokenizer" in _error_line(err)
    assert not list((tmp_path / "o").glob("shard_*"))


# ---- the whole path: a server's answers -> torchrun training -> a served drafter --------------
def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers go with it
        raise
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.slow
def test_from_a_served_target_to_a_served_drafter(served, chats, tmp_path):
    """d3d serve -> d3d datagen --server (4 in flight, a multi-turn ShareGPT record) ->
    torchrun --nproc_per_node 2 train on gloo -> d3d bench: the drafter's greedy output is the
    target's own."""
    target = served[0]
    data, run = tmp_path / "data", tmp_path / "run"
    rc, _ = _datagen(_server_args(served, chats, data))
    assert rc == 0 and max(s.response.max() for s in load_samples(data)) > 0
    _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "sglang_d3d", "train", "--target", target, "--data-dir", str(data),
         "--out-dir", str(run), "--block-size", "4", "--num-anchors", "2", "--rank", "4",
         "--alpha", "4", "--batch-size", "2", "--max-steps", "2", "--warmup-steps", "1",
         "--heldout-every", "4", "--eval-every", "100", "--eval-samples", "2",
         "--no-initial-eval", "--no-tensorboard")
    drafter = run / "drafter"
    assert (drafter / "config.json").exists() and (drafter / "README.md").exists()
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"w5 w9 w{HIGH}"},
                                                  {"prompt": "w40 w41"}])
    out = tmp_path / "bench.json"
    _run("-m", "sglang_d3d", "bench", "--target", target, "--drafter", str(drafter),
         "--dataset", prompts, "--num-prompts", "2", "--max-new-tokens", "12",
         "--block-size", "4", "--modes", "ar,sync,async", "--threads", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["greedy_identical"] is True


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path, capsys):
    from transformers import Gemma2Config

    folder = tmp_path / "gemma2"
    folder.mkdir()
    Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(folder)
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w5 w6"}])
    rc, err = _datagen(["--target", str(folder), "--prompts", prompts,
                        "--out-dir", str(tmp_path / "out")], capsys)
    assert rc != 0
    line = [ln for ln in err.splitlines() if "gemma2" in ln]
    assert len(line) == 1 and "supported: llama, mistral, qwen2, qwen3" in line[0]
    assert not list((tmp_path / "out").glob("shard_*"))


def test_a_config_key_that_does_not_exist_is_refused_in_one_line(tmp_path, capsys):
    from sglang_d3d.training.train import main as train_main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-steps: 2\nlearning-rate: 0.1\n")  # the flag is --lr
    assert train_main(["--config", str(cfg), "--out-dir", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'learning-rate'" in err[0], err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_ids_outside_the_targets_vocabulary_are_refused(tmp_path):
    from sglang_d3d.models.loading import load_tokenizer
    from sglang_d3d.training.datagen import vocab_size
    from sglang_d3d.training.datagen_async import check_vocabulary
    from sglang_d3d.training.datagen_server import ServerError

    target = Path(make_tiny_target(tmp_path / "t"))
    n = vocab_size(target, load_tokenizer(target))
    assert n == json.loads((target / "config.json").read_text())["vocab_size"]
    check_vocabulary([0, n - 1], n)
    with pytest.raises(ServerError, match=f"token id {n}, outside the target's vocabulary of {n}"):
        check_vocabulary([3, n, 4], n)


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_one_line(tmp_path, capsys):
    """--chat-template-kwargs '{"enable_thinking": false}' (Qwen3 with thinking off) goes to
    every chat template datagen renders."""
    from sglang_d3d.training.datagen_async import encode_chat

    class Tok:
        def apply_chat_template(self, messages, **kw):
            self.kw = kw
            return "text"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1, 2]}

    tok = Tok()
    assert encode_chat(tok, [{"role": "user", "content": "w5"}], '{"enable_thinking": false}')
    assert tok.kw["enable_thinking"] is False and tok.kw["add_generation_prompt"] is True
    encode_chat(tok, [{"role": "user", "content": "w5"}])
    assert "enable_thinking" not in tok.kw  # the template's own default
    for bad in ("[1]", "{thinking"):
        rc, err = _datagen(["--chat-template-kwargs", bad, "--out-dir", str(tmp_path)], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "--chat-template-kwargs" in err
