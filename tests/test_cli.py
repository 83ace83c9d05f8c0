"""The `d3d` command line on the tiny pair: generate (text and --json) and bench."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_d3d.cli import main


def _engine_flags(pair) -> list[str]:
    target, drafter = pair
    return ["--target", target, "--drafter", drafter, "--block-size", "4", "--max-context", "256"]


@pytest.mark.parametrize("mode", ["ar", "sync", "async"])
def test_generate_json(tiny_pair_dir, capsys, mode):
    rc = main(["generate", "--prompt", "w5 w6 w7", "--mode", mode, "--max-new-tokens", "12",
               "--json", *_engine_flags(tiny_pair_dir)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 12 and out["finish_reason"] in ("stop", "length")
    assert out["stats"]["mode"] == mode and out["stats"]["generated_tokens"] == len(out["token_ids"])
    assert isinstance(out["text"], str)


def test_generate_modes_agree(tiny_pair_dir, capsys):
    ids = []
    for mode in ("ar", "async"):
        main(["generate", "--prompt", "w9 w10", "--mode", mode, "--max-new-tokens", "16", "--json",
              *_engine_flags(tiny_pair_dir)])
        ids.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert ids[0] == ids[1]


def test_generate_modes_agree_under_penalties(tiny_pair_dir, capsys):
    ids = []
    for mode, rules in (("ar", []), ("ar", ["--frequency-penalty", "1.5"]),
                        ("async", ["--frequency-penalty", "1.5"])):
        main(["generate", "--prompt", "w9 w10", "--mode", mode, "--max-new-tokens", "16", "--json",
              *rules, *_engine_flags(tiny_pair_dir)])
        ids.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert ids[1] == ids[2] and ids[1] != ids[0]


def test_bench_saves_a_report(tiny_pair_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) for i in range(5, 8)) + "\n")
    out = tmp_path / "bench.json"
    rc = main(["bench", "--dataset", str(data), "--num-prompts", "3", "--max-new-tokens", "10",
               "--modes", "ar,sync,async,async-adaptive", "--out", str(out),
               *_engine_flags(tiny_pair_dir)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["greedy_identical"] is True
    assert set(report["modes"]) == {"ar", "sync", "async", "async-adaptive"}
    # the run it came from, as every results JSON records it
    assert report["weights"].startswith("target ") and report["cpu"] and report["commit"]
    assert report["command"].startswith("d3d ")
    # the adaptive mode timed its plans at batch 1 (the only batch here) before the prompts
    assert set(report["calibration"]) == {"async-adaptive"}
    assert set(report["calibration"]["async-adaptive"]) == {"1"}  # JSON keys
    assert report["modes"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert report["modes"]["ar"]["copy_cycle_fraction"] == 0.0  # plain decoding copies nothing
    assert all(0.0 <= m["copy_cycle_fraction"] <= 1.0 for m in report["modes"].values())
    assert list(report["modes"]["ar"]["by_kind"]) == ["plain"]  # every ar cycle is plain
    for m in report["modes"].values():  # the kinds split every cycle and every token
        kinds = m["by_kind"].values()
        assert sum(k["cycle_share"] for k in kinds) == pytest.approx(1.0)
        assert sum(k["time_share"] for k in kinds) == pytest.approx(1.0)
        assert sum(k["cycle_share"] * k["tokens_per_cycle"] for k in kinds) == pytest.approx(
            m["mean_accepted_length"])
        assert m["by_kind"].get("copy", {}).get("cycle_share", 0.0) == pytest.approx(m["copy_cycle_fraction"])
    assert "draft" in report["modes"]["sync"]["by_kind"]
    printed = capsys.readouterr().out
    assert "greedy outputs identical across modes: True" in printed
    assert "by cycle kind" in printed


def test_bench_mode_names(tiny_pair_dir):
    from sglang_d3d.bench import add_bench_args, mode_config
    from sglang_d3d.config import Mode

    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(_engine_flags(tiny_pair_dir))
    assert mode_config(args, "async-adaptive").adaptive
    assert mode_config(args, "async-adaptive").mode is Mode.ASYNC
    assert not mode_config(args, "sync").adaptive
    assert mode_config(args, "sync@3").spec.block_size == 3
    assert mode_config(args, "sync@3").fixed_block == 3  # '@B' is the block a fixed plan runs
    assert (mode_config(args, "sync").spec.block_size, mode_config(args, "sync").fixed_block) == (4, 4)
    unsized = p.parse_args([f for f in _engine_flags(tiny_pair_dir) if f not in ("--block-size", "4")])
    assert (mode_config(unsized, "sync").spec.block_size, mode_config(unsized, "sync").fixed_block) == (16, None)
    assert mode_config(args, "fused-adaptive@8").adaptive
    assert mode_config(args, "fused-adaptive@8").spec.block_size == 8
    assert mode_config(args, "sync").draft_weights == "auto"
    assert mode_config(args, "sync-int8@8").draft_weights == "int8"
    assert mode_config(args, "sync").draft_input_bits == 8
    assert mode_config(args, "sync-bits14@4").draft_input_bits == 14
    _refused(p, args, tiny_pair_dir, "sync-bits4", r"draft_input_bits must be one of \(8, 14\)",
             ["--draft-input-bits", "12"])
    full = mode_config(args, "async-adaptive-full@4")
    assert full.draft_weights == "full" and full.adaptive and full.spec.block_size == 4
    cut = p.parse_args(_engine_flags(tiny_pair_dir) + ["--draft-cutoff", "0.2"])
    assert mode_config(cut, "sync@8").draft_cutoff == 0.2
    assert mode_config(cut, "async-adaptive-cut0@8").draft_cutoff == 0.0
    assert mode_config(args, "sync-cut0.05-full@8").draft_cutoff == 0.05
    _refused(p, args, tiny_pair_dir, "sync-cut1@8", r"cutoff must be in \[0, 1\)",
             ["--draft-cutoff", "2"])
    for bad in ("async-fast", "sync@x", "sync-int4", "sync-int8-full", "sync-cutx", "sync-cut0-cut1",
                "turbo", "sync@0", "int8"):
        with pytest.raises(ValueError, match="unknown mode"):
            mode_config(args, bad)


def _refused(p, args, pair, mode: str, match: str, flags: list[str]) -> None:
    """A bad value in a mode's suffix is a ValueError naming the setting; the same setting out
    of range on the command line is a usage error, not a traceback."""
    from sglang_d3d.bench import mode_config

    with pytest.raises(ValueError, match=match):
        mode_config(args, mode)
    with pytest.raises(SystemExit):
        p.parse_args(_engine_flags(pair) + flags)


@pytest.mark.parametrize("flag,value", [("--frequency-penalty", "5"), ("--presence-penalty", "nan"),
                                        ("--repetition-penalty", "0"), ("--min-p", "1.5")])
def test_out_of_range_sampling_flags_are_usage_errors(tiny_pair_dir, capsys, flag, value):
    for command in ("generate", "bench"):
        with pytest.raises(SystemExit) as e:  # before any model loads
            main([command, "--prompt", "w5", flag, value, *_engine_flags(tiny_pair_dir)]
                 if command == "generate" else [command, flag, value, *_engine_flags(tiny_pair_dir)])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_bench_loads_the_drafter_when_the_last_mode_is_ar(tiny_pair_dir, monkeypatch):
    """Models load with a drafting mode's config wherever it stands in --modes: with `ar` last
    and no --drafter, async stopped with "mode async needs a drafter"."""
    from sglang_d3d import bench
    from sglang_d3d.config import Mode

    seen = []

    def load(cfg):
        seen.append(cfg.mode)
        raise KeyboardInterrupt  # stop once the models would load

    monkeypatch.setattr(bench, "load_models", load)
    flags = [f for f in _engine_flags(tiny_pair_dir) if f != "--drafter" and f != tiny_pair_dir[1]]
    for modes, expected in (("async,ar", Mode.ASYNC), ("sync@4,ar", Mode.SYNC), ("ar", Mode.AR)):
        with pytest.raises(KeyboardInterrupt):
            main(["bench", "--dataset", "gsm8k", "--num-prompts", "1", "--modes", modes, *flags])
        assert seen[-1] is expected


def test_bench_bad_mode_is_a_usage_error(tiny_pair_dir, capsys):
    """A misspelt mode stops at argument parsing with the accepted forms, before any model
    loads (it was a traceback from Mode() after loading)."""
    with pytest.raises(SystemExit) as e:
        main(["bench"] + _engine_flags(tiny_pair_dir) + ["--modes", "ar,asynch"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown mode 'asynch'" in err and "@<block size>" in err
    with pytest.raises(SystemExit):
        main(["bench"] + _engine_flags(tiny_pair_dir) + ["--modes", "sync-cut1.5"])
    assert "cutoff must be in [0, 1)" in capsys.readouterr().err


def test_parse_mode():
    from sglang_d3d.bench import mode_list, parse_mode
    from sglang_d3d.config import Mode

    m = parse_mode("async-adaptive-cut0.05-int8@8")
    assert (m.base, m.adaptive, m.weights, m.cutoff, m.block) == (Mode.ASYNC, True, "int8", 0.05, 8)
    assert parse_mode("ar") == parse_mode("ar")
    assert (parse_mode("ar").block, parse_mode("ar").cutoff, parse_mode("ar").weights) == (None,) * 3
    assert mode_list("ar, sync@8,") == ["ar", "sync@8"]
    with pytest.raises(argparse.ArgumentTypeError, match="'ar' is given more than once"):
        mode_list("ar,async,ar")
    m = parse_mode("sync-tree7-lookup0-copy3@4")
    assert (m.counts, m.block) == (
        (("tree_nodes", 7), ("lookup_tokens", 0), ("copy_ngram", 3)), 4)
    assert parse_mode("async-adaptive-shared0@8").counts == (("shared_lookup_tokens", 0),)
    for bad in ("sync-tree5-tree6", "sync-lookupx", "sync-copy-1", "async-sharedx"):
        with pytest.raises(ValueError, match="unknown mode"):
            parse_mode(bad)


def test_bad_dataset_row_is_reported(tmp_path):
    from sglang_d3d.prompts import load_questions, question_text

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no known field"}) + "\n")
    with pytest.raises(ValueError, match="no usable turn in 1 line"):
        load_questions(str(bad))
    with pytest.raises(ValueError, match="row has no user turn: \\['text'\\]"):
        question_text({"text": "no known field"})


CHATS = [  # every shape `d3d datagen --prompts` reads, a multi-turn one, and two broken lines
    {"conversations": [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7"},
                       {"from": "human", "value": "w8"}]},
    {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w9 w10"}]},
    {"prompt": "w11 w12"},
    {"turns": ["w13", "w14"]},
    {"messages": [{"role": "assistant", "content": "no user turn"}]},
]


def _chat_file(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in CHATS) + "\n{not json\n")
    return f


def test_a_chat_file_in_datagens_shapes_reads_as_first_user_turns(tmp_path, capsys):
    from sglang_d3d.prompts import load_questions, question_text

    f = _chat_file(tmp_path)
    assert load_questions(str(f)) == [
        "w5 w6", ({"role": "system", "content": "w1"}, {"role": "user", "content": "w9 w10"}),
        "w11 w12", "w13"]
    printed = capsys.readouterr().out
    assert "4 prompt(s)" in printed and "2 with later turns not asked" in printed
    assert "2 line(s) skipped: not JSON or no user turn" in printed
    assert [question_text(r) for r in CHATS[:4]] == ["w5 w6", "w9 w10", "w11 w12", "w13"]


def test_bench_runs_on_a_sharegpt_and_messages_file(tiny_pair_dir, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--dataset", str(_chat_file(tmp_path)), "--num-prompts", "3",
               "--max-new-tokens", "6", "--modes", "ar,sync@4", "--out", str(out),
               *_engine_flags(tiny_pair_dir)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["greedy_identical"] is True
    assert report["prompts_run"] == 3 and report["modes"]["ar"]["tokens"] >= 3


def test_the_code_prompt_kind_ships_with_the_package_and_unknown_sets_are_named():
    from sglang_d3d.prompts import load_questions

    tasks = load_questions("mbpp")
    assert len(tasks) == 64 and all(t.startswith("Write a") for t in tasks)
    assert load_questions("mbpp", 3) == tasks[:3]
    with pytest.raises(ValueError, match="one of gsm8k, mbpp, mt_bench, or a FILE.jsonl"):
        load_questions("humaneval")


def test_bench_bad_dataset_fails_before_the_models_load(tiny_pair_dir, monkeypatch):
    import sglang_d3d.bench as bench

    def no_load(cfg):
        raise AssertionError("models loaded before --dataset was checked")

    monkeypatch.setattr(bench, "load_models", no_load)
    with pytest.raises(ValueError, match="unknown dataset 'humaneval'"):
        main(["bench", "--dataset", "humaneval", *_engine_flags(tiny_pair_dir)])


def test_bench_refuses_bad_chat_template_kwargs_before_the_models_load(tiny_pair_dir,
                                                                        monkeypatch):
    import sglang_d3d.bench as bench

    def no_load(cfg):
        raise AssertionError("models loaded before --chat-template-kwargs was checked")

    monkeypatch.setattr(bench, "load_models", no_load)
    with pytest.raises(ValueError, match="must be a JSON object"):
        main(["bench", "--chat-template-kwargs", "[1]", *_engine_flags(tiny_pair_dir)])


def test_chat_ids_pass_template_options_to_the_template():
    from sglang_d3d.prompts import chat_ids

    class Tok:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, msgs, **kw):
            self.kw = kw
            return "x"

        def encode(self, text, add_special_tokens=True):
            return [1]

    tok = Tok()
    assert chat_ids(tok, "w5", {"enable_thinking": False}) == [1]
    assert tok.kw["enable_thinking"] is False


def test_bench_runs_a_second_drafter_side_by_side(tiny_pair_dir, tmp_path, monkeypatch):
    import shutil

    import sglang_d3d.bench as bench

    alt = tmp_path / "alt_drafter"
    shutil.copytree(tiny_pair_dir[1], alt)
    seen = {}
    real = bench.SpecEngine

    def recording(cfg, target, drafter, *rest):
        seen[(cfg.mode.value, cfg.spec.block_size)] = drafter
        return real(cfg, target, drafter, *rest)

    monkeypatch.setattr(bench, "SpecEngine", recording)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    out = tmp_path / "bench.json"
    rc = main(["bench", "--dataset", str(data), "--num-prompts", "1", "--max-new-tokens", "8",
               "--modes", "ar,sync@4,sync-alt@3", "--alt-drafter", str(alt), "--out", str(out),
               *_engine_flags(tiny_pair_dir)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["greedy_identical"] is True and report["alt_drafter"] == str(alt)
    assert seen[("ar", 4)] is None
    assert seen[("sync", 3)] is not None and seen[("sync", 3)] is not seen[("sync", 4)]


def test_alt_modes_and_the_alt_drafter_need_each_other():
    from sglang_d3d.bench import check_alt, parse_mode

    assert parse_mode("async-adaptive-alt@8").alt and not parse_mode("async@8").alt
    with pytest.raises(ValueError, match="run with --alt-drafter"):
        check_alt(argparse.Namespace(alt_drafter=None), ["ar", "sync-alt"])
    with pytest.raises(ValueError, match="no mode runs with it"):
        check_alt(argparse.Namespace(alt_drafter="x"), ["ar", "sync"])
    check_alt(argparse.Namespace(alt_drafter="x"), ["ar", "sync-alt"])


def test_bench_refuses_a_missing_alt_drafter_before_the_models_load(tiny_pair_dir, tmp_path,
                                                                     monkeypatch):
    import sglang_d3d.bench as bench

    def no_load(cfg):
        raise AssertionError("models loaded before --alt-drafter was checked")

    monkeypatch.setattr(bench, "load_models", no_load)
    with pytest.raises(FileNotFoundError, match="no D3D drafter checkpoint"):
        main(["bench", "--modes", "ar,sync-alt", "--alt-drafter", str(tmp_path / "nowhere"),
              *_engine_flags(tiny_pair_dir)])


def test_generate_under_a_grammar_is_the_same_in_every_mode(tiny_pair_dir, capsys):
    ids = []
    for mode in ("ar", "sync", "async"):
        rc = main(["generate", "--prompt", "w9 w10", "--mode", mode, "--max-new-tokens", "16",
                   "--json", "--regex", "(w5|w6)w7", *_engine_flags(tiny_pair_dir)])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["finish_reason"] == "stop"
        ids.append(out["token_ids"])
    assert ids[0] == ids[1] == ids[2] and ids[0][:2] in ([5, 7], [6, 7]) and ids[0][2:] == [2]


def test_bench_records_its_grammar(tiny_pair_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) for i in range(5, 7)) + "\n")
    out = tmp_path / "bench.json"
    rc = main(["bench", "--dataset", str(data), "--num-prompts", "2", "--max-new-tokens", "8",
               "--modes", "ar,sync", "--ebnf", 'root ::= ("w5" | "w6")+', "--out", str(out),
               *_engine_flags(tiny_pair_dir)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["greedy_identical"] is True
    assert report["grammar"] == {"kind": "ebnf", "source": 'root ::= ("w5" | "w6")+'}


@pytest.mark.parametrize("flags, says", [
    (["--json-schema", "{not json"], "not JSON"),
    (["--json-schema", "@/no/such/schema.json"], "cannot read"),
    (["--regex", " "], "non-empty source"),
    (["--regex", "a", "--ebnf", 'root ::= "a"'], "not allowed with"),
    (["--response-format", "json", "--regex", "a"], "not allowed with"),
])  # fmt: skip
def test_grammar_flags_are_checked_before_the_models_load(tiny_pair_dir, capsys, flags, says):
    for command in (["generate", "--prompt", "w5"], ["bench"]):
        with pytest.raises(SystemExit) as e:
            main([*command, *flags, *_engine_flags(tiny_pair_dir)])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_grammar_that_does_not_compile_is_an_error_not_a_traceback(tiny_pair_dir, capsys):
    rc = main(["generate", "--prompt", "w5", "--regex", "a(", *_engine_flags(tiny_pair_dir)])
    assert rc == 2 and "invalid regex" in capsys.readouterr().err
