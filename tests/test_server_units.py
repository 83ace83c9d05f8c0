"""Server pieces alone: flags, stop strings, incremental detokenisation, backend checks."""

from __future__ import annotations

import random

import pytest
from sglang_d3d.server.args import Backend, parse_args
from sglang_d3d.server.backends import BackendUnavailable, check_backend
from sglang_d3d.server.detokenize import StopMatcher, TextStream, find_stop, partial_stop_len
from sglang_d3d.server.main import run_server

from sglang_d3d.config import BranchPolicy, EngineConfig, Mode, SpecConfig
from sglang_d3d.testing import tiny_tokenizer

# ---- args -------------------------------------------------------------------------------------


def test_no_flags_gives_the_engine_defaults():
    import dataclasses
    import os

    cfg = parse_args([])
    # A server adapts its block size to the load, and splits the cores between the two models.
    # It times its plans at start-up, so no request pays for the controller's warm-up.
    assert cfg.engine.adaptive is True and cfg.engine.calibrate is True
    assert parse_args(["--no-calibrate"]).engine.calibrate is False
    assert cfg.engine.target_threads + cfg.engine.draft_threads == max(2, os.cpu_count() or 1)
    same = dataclasses.replace(cfg.engine, adaptive=False, calibrate=False, target_threads=1,
                               draft_threads=1)
    assert same == EngineConfig()
    assert cfg.backend is Backend.EMBEDDED and cfg.model_name == "SmolLM2-135M-Instruct"


def test_flags_map_onto_engine_config():
    cfg = parse_args(
        "--target /m/qwen3-0.6b --drafter /d --mode sync --max-concurrency 4 --max-queue 9 "
        "--block-size 8 --branch-policy all --branch-budget 2 --guesses-per-position 3 "
        "--device cuda:0 --draft-device cuda:1 --max-context 4096 --port 9000 "
        "--backend sglang".split()
    )
    e = cfg.engine
    assert (e.target_path, e.drafter_path, e.mode) == ("/m/qwen3-0.6b", "/d", Mode.SYNC)
    assert (e.max_batch_size, e.max_queue, e.max_context) == (4, 9, 4096)
    assert e.spec == SpecConfig(8, BranchPolicy.ALL, 2, 3)
    assert (e.device, e.resolved_draft_device) == ("cuda:0", "cuda:1")
    assert cfg.port == 9000 and cfg.backend is Backend.SGLANG
    assert cfg.model_name == "qwen3-0.6b"  # the target folder's name unless --served-model-name


def test_the_default_target_has_one_name_however_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "smollm2-135m-instruct"  # where the default target is converted
    for given in ([], ["--target", "default"], ["--target", str(folder)],
                  ["--target", str(folder) + "/"]):
        assert parse_args(given).model_name == "SmolLM2-135M-Instruct", given
    assert parse_args(["--target", str(tmp_path / "mine")]).model_name == "mine"


@pytest.mark.parametrize(
    "argv", [["--block-size", "1"], ["--mode", "fast"], ["--max-concurrency", "0"], ["--port", "x"],
             ["--draft-weights", "int4"]]
)
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_draft_weights_reach_the_engine_and_int8_is_refused_for_sglang(capsys):
    assert parse_args([]).engine.draft_weights == "auto"
    assert parse_args(["--draft-weights", "full"]).engine.draft_weights == "full"
    with pytest.raises(SystemExit):
        parse_args(["--backend", "sglang", "--draft-weights", "int8"])
    assert "int8 is for the embedded backend" in capsys.readouterr().err


@pytest.mark.parametrize("flag, field", [("--tree-nodes", "tree_nodes"),
                                         ("--lookup-tokens", "lookup_tokens")])
def test_tree_flags_reach_the_engine_and_are_refused_for_sglang(capsys, flag, field):
    # both None, which the engine sets from the target (config.verify_widths)
    assert getattr(parse_args([]).engine, field) == getattr(EngineConfig, field)
    assert getattr(parse_args([flag, "0"]).engine, field) == 0
    assert getattr(parse_args([flag, "9"]).engine, field) == 9
    assert getattr(parse_args(["--backend", "sglang"]).engine, field) == 0  # its worker: chains
    with pytest.raises(SystemExit):
        parse_args([flag, "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--backend", "sglang", flag, "5"])
    assert "--lookup-tokens are for the embedded backend" in capsys.readouterr().err


# ---- stop strings -----------------------------------------------------------------------------


def test_find_stop_and_partial_suffix():
    assert find_stop("abcSTOPx", ["STOP", "c"], 0) == 2
    assert find_stop("abc", ["z"], 0) is None
    assert partial_stop_len("hello ST", ["STOP"]) == 2
    assert partial_stop_len("hello", ["STOP"]) == 0


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_stop_matcher_equals_a_search_over_the_whole_text():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        m, released, cuts = StopMatcher(stops), [], sorted(rng.sample(range(31), 5))
        for a, b in zip([0] + cuts, cuts + [len(text)], strict=True):
            released.append(m.feed(text[a:b]))
            # what went out is never more than the final answer
            assert _reference(text, stops)[0].startswith("".join(released))
        released.append(m.flush())
        assert ("".join(released), m.stopped) == _reference(text, stops)


def test_stop_matcher_skips_the_text_before_min_tokens():
    """Text fed through `skip` is released whole and no match starts inside it, not even one
    that ends in later text; matches after it are found as usual."""
    rng = random.Random(2)
    for _ in range(300):
        text = "".join(rng.choice("ab ") for _ in range(rng.randrange(0, 20)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 3)))]
        floor = rng.randrange(0, len(text) + 1)
        m = StopMatcher(stops)
        out = m.skip(text[:floor]) + m.feed(text[floor:]) + m.flush()
        rest, stopped = _reference(text[floor:], stops)
        assert (out, m.stopped) == (text[:floor] + rest, stopped)


# ---- detokenisation ---------------------------------------------------------------------------


def test_text_stream_equals_a_full_decode():
    tok = tiny_tokenizer()
    rng = random.Random(1)
    prompt = [rng.randrange(3, 96) for _ in range(5)]
    out = [rng.randrange(0, 96) for _ in range(40)]  # includes <unk>, <s>, </s> (special)
    stream = TextStream(tok, prompt, [])
    text = "".join(stream.add(t) for t in out) + stream.finish()
    full = tok.decode(prompt + out, skip_special_tokens=True)
    assert full.endswith(text) and text.strip() == tok.decode(out, skip_special_tokens=True)


def test_text_stream_stops_on_a_string_spanning_tokens():
    tok = tiny_tokenizer()
    ids = tok("w5 w6 w7 w8", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, [4], ["w6 w7"])
    pieces = []
    for t in ids:
        pieces.append(stream.add(t))
        if stream.stopped:
            break
    assert stream.stopped and "".join(pieces) == " w5 "


# ---- backends ---------------------------------------------------------------------------------


def test_only_the_sglang_backend_needs_sglang(monkeypatch):
    """On a machine without SGLang, --backend sglang is refused with the install command and
    the embedded backend still passes."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )
    with pytest.raises(BackendUnavailable, match=r"pip install '\.\[sglang\]'"):
        check_backend(Backend.SGLANG)
    assert check_backend(Backend.EMBEDDED) is None


def test_sglang_backend_without_cuda_fails_clearly(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(BackendUnavailable, match="--backend"):
        check_backend(Backend.SGLANG)
    assert run_server(["--backend", "sglang"]) == 2
    assert "--backend" in capsys.readouterr().err


def test_serve_exits_nonzero_when_the_model_cannot_load(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    argv = ["--target", missing, "--host", "127.0.0.1", "--port", "0", "--log-level", "error"]
    assert run_server(argv) == 1
    assert "no-such-model" in capsys.readouterr().err
