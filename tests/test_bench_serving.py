"""`d3d bench-serving` against a running tiny server: plain, logprobs and n requests, and the
cost of the last two against plain. A few requests; no timing is asserted."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sglang_d3d.benchmarks import bench_serving as bench
from sglang_d3d.benchmarks import serving_stats as stats
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.config import Mode

pytestmark = pytest.mark.slow


def _gsm8k(tmp_path, monkeypatch, questions: list[str]):
    """A datasets folder whose GSM8K test split holds `questions`, made the one bench reads."""
    data = tmp_path / "datasets"
    (data / "gsm8k").mkdir(parents=True)
    path = data / "gsm8k" / "test.jsonl"
    path.write_text("\n".join(json.dumps({"question": q}) for q in questions))
    monkeypatch.setenv("D3D_DATASETS", str(data))
    return path


def test_variants_are_sent_and_costed(tiny_pair_dir, tmp_path, monkeypatch):
    _gsm8k(tmp_path, monkeypatch, [f"w{5 + i} w{6 + i} w{7 + i}" for i in range(4)])
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), api_keys=("bench-key",))
    out = tmp_path / "bench.json"
    with ServerThread(create_app(cfg)) as srv:
        argv = ["--url", srv.url, "--datasets", "gsm8k", "--concurrency", "2",
                "--num-prompts", "4", "--max-tokens", "6", "--n", "3", "--top-logprobs", "4",
                "--api-key", "bench-key", "--out", str(out)]  # fmt: skip
        assert bench.main(argv) == 0
    saved = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in saved["results"]}
    assert set(by_variant) == {"plain", "logprobs", "n"}
    for r in by_variant.values():
        assert r["num_failed"] == 0 and r["mode"] == "async"
    # n=3: three choices' tokens per request, each request as long as a plain one at most
    assert by_variant["n"]["total_output_tokens"] > by_variant["plain"]["total_output_tokens"]
    assert by_variant["n"]["total_output_tokens"] <= 3 * 4 * 6
    costs = {c["variant"]: c for c in saved["costs"]}
    assert set(costs) == {"logprobs", "n"}
    for c in costs.values():
        assert c["output_throughput_ratio"] > 0 and c["tpot_mean_ratio"] > 0


def test_request_bodies_per_variant():
    args = bench.build_parser().parse_args(["--n", "4", "--top-logprobs", "7"])
    plain = bench.request_body("m", "hi", args)
    assert "n" not in plain and "logprobs" not in plain
    assert bench.request_body("m", "hi", args, "logprobs") == plain | {
        "logprobs": True,
        "top_logprobs": 7,
    }
    assert bench.request_body("m", "hi", args, "n") == plain | {"n": 4}
    extra = ["--extra-body", '{"frequency_penalty": 0.5, "ignore_eos": true, "temperature": 0.7}']
    ruled = bench.request_body("m", "hi", bench.build_parser().parse_args(extra), "n")
    assert ruled == plain | {"n": 2, "frequency_penalty": 0.5, "ignore_eos": True, "temperature": 0.7}
    for bad in ("{", "[1]"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["--extra-body", bad])
    r = bench.RequestResult(ok=True, latency=1.0, ttft=0.2, output_tokens=9, sequences=3)
    assert r.tpot == pytest.approx(0.8 / 2)  # 3 tokens per choice


def test_warm_up_sends_other_prompts_unmeasured(tmp_path, monkeypatch):
    test_set = _gsm8k(tmp_path, monkeypatch, [f"question {i}" for i in range(20)])
    sent = []

    async def fake_load(url, model, prompts, concurrency, variant, args):
        sent.append((list(prompts), concurrency, variant))
        return [], 0.0

    monkeypatch.setattr(bench, "run_load", fake_load)
    args = bench.build_parser().parse_args(["--num-prompts", "6", "--warmup-rounds", "2"])
    bench.warm_up("http://x", "m", "gsm8k", 3, args)
    measured = bench.load_prompts(test_set, 6, args.seed)
    (prompts, conc, variant), = sent
    assert len(prompts) == 6 and conc == 3 and variant == "plain"
    assert not set(prompts) & set(measured)
    args.warmup_rounds = 0
    bench.warm_up("http://x", "m", "gsm8k", 3, args)
    assert len(sent) == 1  # a cold run sends nothing first


def test_datasets_are_named_sets_or_jsonl_files(tmp_path, capsys):
    code = tmp_path / "code.jsonl"
    code.write_text('{"prompt": "Write a function."}\n{"prompt": "Sort a list."}\n')
    args = bench.build_parser().parse_args(["--datasets", "gsm8k", "mbpp", str(code)])
    assert args.datasets == ["gsm8k", "mbpp", str(code)]
    assert len(bench.load_prompts(bench.dataset_path("mbpp"), 20)) == 20  # bundled code tasks
    assert sorted(bench.load_prompts(code, 2)) == ["Sort a list.", "Write a function."]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--datasets", str(tmp_path / "missing.jsonl")])
    assert "existing .jsonl file" in capsys.readouterr().err


def test_started_servers_copy_nothing_from_repeated_prompts_unless_asked():
    """Loads repeat their prompts, so the servers the benchmark starts keep no index of earlier
    requests' text (it would verify the answers to the same prompts); --server-args may ask."""
    assert bench.started_server_args("--device cpu") == [
        "--device", "cpu", "--shared-lookup-tokens", "0"]
    assert bench.started_server_args("--shared-lookup-tokens 4096") == ["--shared-lookup-tokens", "4096"]
    assert bench.started_server_args("--shared-lookup-tokens=8") == ["--shared-lookup-tokens=8"]
    assert bench.started_server_args("--device cpu", fresh_prompts=True) == ["--device", "cpu"]


def test_fresh_prompts_give_every_load_its_own_and_the_warm_ups_others(tmp_path, monkeypatch, capsys):
    _gsm8k(tmp_path, monkeypatch, [f"question {i}" for i in range(20)])
    sent = []

    async def fake_load(url, model, prompts, concurrency, variant, args):
        sent.append(list(prompts))
        return [], 0.0

    monkeypatch.setattr(bench, "run_load", fake_load)
    monkeypatch.setattr(bench, "measure", lambda url, mode, model, load, args, headers:
                        (sent.append(list(load.prompts)), {})[1])
    monkeypatch.setattr(bench, "served_model", lambda url, headers: "m")
    monkeypatch.setattr(bench, "print_table", lambda rows, header=False: None)
    monkeypatch.setattr(bench, "run_load_once", lambda url, body, headers: fake_load(
        url, None, [], 1, "plain", None))  # the "Hello!" request at the start
    argv = ["--datasets", "gsm8k", "--concurrency", "1", "2", "--num-prompts", "4",
            "--variants", "plain", "logprobs", "--fresh-prompts"]  # fmt: skip
    bench.bench_modes({"ar": "http://x"}, bench.build_parser().parse_args(argv))
    warm, loads = [p for p in sent if len(p) < 4], [p for p in sent if len(p) == 4]
    assert len(loads) == 4 and len({q for p in loads for q in p}) == 16  # none twice
    assert not {q for p in warm for q in p} & {q for p in loads for q in p}
    with pytest.raises(SystemExit, match="has 20 prompts"):  # 4 loads x 5 + warm-ups > 20
        bench.bench_modes({"ar": "http://x"}, bench.build_parser().parse_args(
            [*argv[:6], "5", *argv[7:]]))
    with pytest.raises(SystemExit):
        bench.main(["--fresh-prompts", "--rounds", "2"])
    assert "needs --fresh-servers" in capsys.readouterr().err


def test_negative_warm_up_rounds_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--warmup-rounds", "-1"])
    assert "must be 0 or more" in capsys.readouterr().err


def test_modes_take_each_load_in_turn(tiny_pair_dir, tmp_path, monkeypatch):
    _gsm8k(tmp_path, monkeypatch, [f"w{5 + i} w{6 + i}" for i in range(4)])
    ar = tiny_server_config(tiny_pair_dir, mode=Mode.AR)
    args = bench.build_parser().parse_args(
        ["--datasets", "gsm8k", "--concurrency", "1", "2", "--num-prompts", "2",
         "--max-tokens", "4", "--variants", "plain", "--warmup-rounds", "0"])  # fmt: skip
    with ServerThread(create_app(ar)) as a, ServerThread(create_app(tiny_server_config(tiny_pair_dir))) as b:
        got = bench.bench_modes({"ar": a.url, "async": b.url}, args)
    # each load through both, the next load starting with the other mode
    assert [(r["mode"], r["concurrency"]) for r in got] == [
        ("ar", 1), ("async", 1), ("async", 2), ("ar", 2)]
    assert all(r["num_failed"] == 0 and r["total_output_tokens"] > 0 for r in got)
    assert got[0]["mean_accepted_length"] == 1.0  # each row's figures come from its own server
    # share of cycle time decoding plainly: all of ar's, none of async's at a fixed block 4
    assert [r["plain_time_share"] for r in got] == [1.0, 0.0, 0.0, 1.0]


def _fake_loads(monkeypatch, speed: dict[str, list[float]]) -> list[str]:
    """bench_modes without servers: each mode's k-th load runs at speed[mode][k] tok/s.
    -> the modes in the order they were measured."""
    seen = []

    def fake_measure(url, mode, model, load, args, headers):
        k = seen.count(mode)
        seen.append(mode)
        return {"mode": mode, "dataset": load.dataset, "concurrency": load.concurrency,
                "variant": load.variant, "output_throughput": speed[mode][k],
                "tpot_ms": {"mean": 1000 / speed[mode][k]}, "ttft_ms": {"mean": None}}

    async def no_request(*_):
        return None

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "served_model", lambda url, headers=None: "m")
    monkeypatch.setattr(bench, "run_load_once", no_request)
    monkeypatch.setattr(bench, "warm_up", lambda *a: None)
    monkeypatch.setattr(bench, "print_table", lambda *a, **k: None)
    return seen


ROUNDS = ["--datasets", "gsm8k", "--concurrency", "4", "--variants", "plain", "--rounds", "2"]


def test_rounds_alternate_the_modes_and_are_paired(tmp_path, monkeypatch):
    _gsm8k(tmp_path, monkeypatch, [f"question {i}" for i in range(4)])
    _fake_loads(monkeypatch, {"ar": [100.0, 80.0], "async": [110.0, 84.0]})  # 1.10x, 1.05x
    args = bench.build_parser().parse_args(ROUNDS)
    rows = bench.bench_modes({"ar": "http://a", "async": "http://b"}, args)
    assert [(r["mode"], r["round"]) for r in rows] == [
        ("ar", 0), ("async", 0), ("async", 1), ("ar", 1)]  # no mode always first
    (entry,) = bench.paired_ratios(rows, "ar")
    assert entry["mode"] == "async" and entry["concurrency"] == 4
    tok = entry["tok_s"]
    assert tok["rounds"] == 2 and tok["ratio"] == pytest.approx((1.10 * 1.05) ** 0.5)
    assert (tok["low"], tok["high"]) == (pytest.approx(1.05), pytest.approx(1.10))
    assert entry["tpot_mean"]["ratio"] == pytest.approx(1 / tok["ratio"])
    assert entry["ttft_mean"] is None  # no round has the figure


def test_fresh_servers_start_for_every_round(tmp_path, monkeypatch):
    _gsm8k(tmp_path, monkeypatch, [f"question {i}" for i in range(4)])
    _fake_loads(monkeypatch, {"ar": [100.0, 80.0], "async": [110.0, 84.0]})
    events = []

    class FakeServer:
        def __init__(self, mode, extra, log_dir, timeout):
            self.url = f"http://{mode}-{len(events)}"
            events.append(("start", mode))

        def stop(self):
            events.append(("stop", self.url))

    monkeypatch.setattr(bench, "ServerProcess", FakeServer)
    args = bench.build_parser().parse_args([*ROUNDS, "--fresh-servers"])
    rows = bench._with_servers(["ar", "async"], args)
    assert [e[0] for e in events] == ["start", "start", "stop", "stop"] * 2
    assert [(r["mode"], r["round"]) for r in rows] == [
        ("ar", 0), ("async", 0), ("async", 1), ("ar", 1)]  # the rotation goes on across servers
    with pytest.raises(SystemExit):
        bench.main([*ROUNDS, "--fresh-servers", "--sequential"])


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--rounds", "0"])
    assert "must be 1 or more" in capsys.readouterr().err


def test_counter_totals_add_up_the_samples_each_figure_names():
    from prometheus_client.parser import text_string_to_metric_families

    text = """# TYPE d3d:spec_plan_seconds counter
d3d:spec_plan_seconds_total{block="1",predraft="false"} 3.0
d3d:spec_plan_seconds_total{block="4",predraft="false"} 1.5
d3d:spec_plan_seconds_total{block="4",predraft="true"} 0.5
# TYPE d3d:spec_accepted_length histogram
d3d:spec_accepted_length_sum{mode="async"} 12.0
d3d:spec_accepted_length_count{mode="async"} 5.0
"""
    got = stats.counter_totals(text_string_to_metric_families(text))
    assert got["busy_seconds"] == 5.0 and got["plain_seconds"] == 3.0
    assert got["accepted_sum"] == 12.0 and got["cycles"] == 5.0 and got["hits"] == 0.0
    figures = stats.spec_figures({}, got)
    plans, by_batch = figures.pop("plans"), figures.pop("plans_by_batch")
    assert figures.pop("speculated") == {}  # a server from before the controller's reasons
    assert figures == {"mean_accepted_length": 2.4, "branch_hit_rate": None, "plain_time_share": 0.6}
    assert plans == {} and by_batch == {}  # no cycle counts in this scrape
    text += """# TYPE d3d:spec_plan_cycles counter
d3d:spec_plan_cycles_total{block="1",predraft="false"} 30.0
d3d:spec_plan_cycles_total{block="4",predraft="true"} 5.0
"""
    earlier = text.replace(" 30.0", " 10.0").replace("} 3.0", "} 1.0")  # 20 plain cycles ago
    before = stats.counter_totals(text_string_to_metric_families(earlier))
    after = stats.counter_totals(text_string_to_metric_families(text))
    plans = stats.spec_figures(before, after)["plans"]
    assert plans == {"1": {"cycles": 20, "mean_ms": pytest.approx(100.0)}}  # only plans used


def test_plans_are_also_told_apart_by_batch_bucket_where_the_server_labels_them():
    from prometheus_client.parser import text_string_to_metric_families

    text = """# TYPE d3d:spec_plan_seconds counter
d3d:spec_plan_seconds_total{block="1",predraft="false",batch="1"} 0.4
d3d:spec_plan_seconds_total{block="1",predraft="false",batch="4"} 3.0
# TYPE d3d:spec_plan_cycles counter
d3d:spec_plan_cycles_total{block="1",predraft="false",batch="1"} 10.0
d3d:spec_plan_cycles_total{block="1",predraft="false",batch="4"} 50.0
# TYPE d3d:spec_plan_tokens counter
d3d:spec_plan_tokens_total{block="1",predraft="false",batch="1"} 10.0
d3d:spec_plan_tokens_total{block="1",predraft="false",batch="4"} 250.0
"""
    got = stats.spec_figures({}, stats.counter_totals(text_string_to_metric_families(text)))
    assert got["plans"] == {"1": {"cycles": 60, "mean_ms": pytest.approx(3400 / 60),
                                  "tokens_per_cycle": pytest.approx(260 / 60)}}
    assert got["plans_by_batch"] == {
        "1": {"1": {"cycles": 10, "mean_ms": pytest.approx(40.0), "tokens_per_cycle": 1.0}},
        "4": {"1": {"cycles": 50, "mean_ms": pytest.approx(60.0), "tokens_per_cycle": 5.0}}}


def test_plan_cells_print_tokens_a_cycle_where_the_server_reports_them():
    plans = {"1": {"cycles": 201, "mean_ms": 94.2, "tokens_per_cycle": 16.0},
             "copy": {"cycles": 27, "mean_ms": 141.6}}  # a server from before spec_plan_tokens
    assert stats.plan_cells(plans) == "1:201@94(16.0) copy:27@142"
    assert stats.plan_cells({}) == ""


def test_speculative_cycles_are_told_apart_by_why_the_controller_ran_them():
    from prometheus_client.parser import text_string_to_metric_families

    text = """# TYPE d3d:controller_plan_cycles counter
d3d:controller_plan_cycles_total{batch="4",block="8",predraft="true",reason="warmup"} 1.0
d3d:controller_plan_cycles_total{batch="4",block="8",predraft="true",reason="estimate"} 3.0
d3d:controller_plan_cycles_total{batch="4",block="1",predraft="false",reason="estimate"} 90.0
d3d:controller_plan_cycles_total{batch="16",block="4",predraft="false",reason="explore"} 2.0
"""
    earlier = text.replace("} 3.0", "} 1.0")
    before = stats.counter_totals(text_string_to_metric_families(earlier))
    after = stats.counter_totals(text_string_to_metric_families(text))
    got = stats.spec_figures(before, after)["speculated"]
    # plain decoding is left out; the load counts only its own cycles (2 of the 3 estimates)
    assert got == {"4": {"8o": {"estimate": 2}}}
    got = stats.spec_figures({}, after)["speculated"]
    assert got == {"16": {"4": {"explore": 2}}, "4": {"8o": {"estimate": 3, "warmup": 1}}}
    assert stats.why_cells(got) == "8o@4:estimate=3,warmup=1 4@16:explore=2"  # by batch size
