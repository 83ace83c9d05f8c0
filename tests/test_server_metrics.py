"""/metrics: the names of docs/design.md, parsed by prometheus-client, moving with traffic."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sglang_d3d.server.app import create_app
from sglang_d3d.server.metrics import CORPUS, SHARED_TEXT, MetricsRecorder
from sglang_d3d.server.testing import ServerThread, tiny_server_config

from sglang_d3d.engine.adaptive import BlockController, Plan
from sglang_d3d.speculative.corpus_lookup import CorpusIndex
from sglang_d3d.speculative.cycle import COPIES
from sglang_d3d.speculative.shared_lookup import TextIndex
from sglang_d3d.speculative.stats import CycleStats

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "spec_accepted_length",
    "spec_draft_time_seconds",
    "spec_verify_time_seconds",
    "spec_cycle_time_seconds",
    "spec_overlap_fraction",
]
COUNTERS = [
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_num_accepted_tokens_per_pos",
    "spec_tree_cycles",
    "spec_copy_cycles",
    "spec_branch_hits",
    "spec_branch_misses",
    "spec_overlap_seconds",
    "spec_cycle_seconds",
    "spec_plan_cycles",
    "spec_plan_seconds",
    "spec_plan_tokens",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "request_rejected",
    "request_errors",
]
GAUGES = ["num_requests_running", "num_requests_waiting"]


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} for every sample in an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in snap.items() if n == name and want <= set(lab))


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


# ---- the recorder alone -----------------------------------------------------------------------


def test_recorder_counts_cycles_exactly():
    rec = MetricsRecorder("m", "async")
    cycles = [
        CycleStats(3, 2, True, 0.01, 0.02, 0.03, 0.01),
        CycleStats(3, 0, False, 0.01, 0.02, 0.04, 0.02),
        CycleStats(3, 3, None, 0.01, 0.02, 0.03, 0.0, tree_nodes=5),
        CycleStats(8, 6, None, 0.0, 0.02, 0.02, 0.0, copied=True),
    ]
    for c in cycles:
        rec.on_cycle("r", c)
    snap = samples(rec.render().decode())
    lab = {"model_name": "m", "mode": "async"}
    assert value(snap, "d3d:spec_num_drafts_total", **lab) == 4
    assert value(snap, "d3d:spec_num_draft_tokens_total", **lab) == 17
    assert value(snap, "d3d:spec_num_accepted_tokens_total", **lab) == 11
    per_pos = [
        value(snap, "d3d:spec_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(7)
    ]
    # cycle 1 accepted positions 0,1; cycle 3 positions 0,1,2; cycle 4 (copied) 0..5
    assert per_pos == [3, 3, 2, 1, 1, 1, 0]
    assert value(snap, "d3d:spec_branch_hits_total") == 1
    assert value(snap, "d3d:spec_branch_misses_total") == 1
    assert value(snap, "d3d:spec_tree_cycles_total") == 1
    assert value(snap, "d3d:spec_copy_cycles_total") == 1
    assert value(snap, "d3d:spec_accepted_length_count") == 4
    assert value(snap, "d3d:spec_accepted_length_sum") == sum(c.accepted_length for c in cycles)
    assert value(snap, "d3d:spec_cycle_seconds_total") == pytest.approx(0.12)
    assert value(snap, "d3d:spec_overlap_seconds_total") == pytest.approx(0.03)


def test_recorder_uses_its_own_registry():
    a, b = MetricsRecorder("m", "ar"), MetricsRecorder("m", "ar")  # no duplicate-name clash
    a.on_cycle("r", CycleStats(0, 0, None, 0.0, 0.01, 0.01, 0.0))
    assert value(samples(a.render().decode()), "d3d:spec_accepted_length_count") == 1
    assert value(samples(b.render().decode()), "d3d:spec_accepted_length_count") == 0
    # target-only cycles carry no drafts: they must not count as drafts
    assert value(samples(a.render().decode()), "d3d:spec_num_drafts_total") == 0


def test_controller_estimates_are_gauges_read_at_scrape_time():
    rec, ctl = MetricsRecorder("m", "async"), None
    rec.watch_controller(lambda: ctl)
    assert "controller" not in rec.render().decode()  # no controller (yet): no series
    ctl = BlockController((Plan(1), Plan(4, True)), prior=(0.5, 0.5, 0.5))
    ctl.observe(2, Plan(1), 0.04, [])
    ctl.observe(2, Plan(4, True), 0.08, [(3, 1), (3, 3)])
    rec.on_plan(2, Plan(4, True), 0.08, 5)
    snap = samples(rec.render().decode())
    plain = {"model_name": "m", "mode": "async", "batch": "2", "block": "1", "predraft": "false"}
    assert value(snap, "d3d:controller_tokens_per_second", **plain) == pytest.approx(2 / 0.04)
    four = {**plain, "block": "4", "predraft": "true"}
    assert value(snap, "d3d:controller_cycle_seconds", **four) == pytest.approx(0.08)
    rates = ctl.accept_rates()
    assert value(snap, "d3d:controller_accept_rate", position="1") == pytest.approx(rates[1])
    want = 2 * (1 + rates[0] + rates[0] * rates[1] + rates[0] * rates[1] * rates[2]) / 0.08
    assert value(snap, "d3d:controller_tokens_per_second", **four) == pytest.approx(want)
    assert value(snap, "d3d:spec_plan_cycles_total", block="4", predraft="true") == 1
    rec.on_plan(5, Plan(1), 0.05, 5)  # labelled with its batch-size bucket, as the estimates are
    assert value(snap := samples(rec.render().decode()), "d3d:spec_plan_cycles_total",
                 block="1", batch="4") == 1
    assert value(snap, "d3d:spec_plan_cycles_total", batch="2") == 1
    rec.on_plan(1, COPIES, 0.03, 3)  # a cycle of copies counts as decoding time, as no plan's
    snap = samples(rec.render().decode())
    assert value(snap, "d3d:spec_plan_seconds_total", block="copy", batch="1") == pytest.approx(0.03)
    assert value(snap, "d3d:spec_plan_tokens_total", block="copy", batch="1") == 3
    assert value(snap, "d3d:spec_plan_tokens_total", block="4", predraft="true", batch="2") == 5
    # why each plan ran: both were measured for the first time, never chosen by `choose`
    assert value(snap, "d3d:controller_plan_cycles_total", **four, reason="estimate") == 1


def test_the_controllers_reasons_are_counters_read_at_scrape_time():
    rec = MetricsRecorder("m", "async")
    ctl = BlockController((Plan(1), Plan(4, True)), warmup=1)
    rec.watch_controller(lambda: ctl)
    for _ in range(3):
        plan = ctl.choose(5)
        ctl.observe(5, plan, 0.05 if plan == Plan(1) else 0.5, [(3, 0)] * 5 if plan.block > 1 else [])
    snap = samples(rec.render().decode())
    at = {"model_name": "m", "mode": "async", "batch": "4"}
    plain, four = {**at, "block": "1", "predraft": "false"}, {**at, "block": "4", "predraft": "true"}
    assert value(snap, "d3d:controller_plan_cycles_total", **plain, reason="warmup") == 1
    assert value(snap, "d3d:controller_plan_cycles_total", **four, reason="warmup") == 1
    assert value(snap, "d3d:controller_plan_cycles_total", **plain, reason="estimate") == 1


def test_the_index_of_earlier_text_is_read_at_scrape_time():
    rec, index = MetricsRecorder("m", "async"), None
    rec.watch_copy_source(SHARED_TEXT, lambda: index)
    assert "shared_lookup" not in rec.render().decode()  # none (off, or loading): no series
    index = TextIndex(capacity=100)
    index.add([1, 2, 3, 4, 5])
    assert index.continuation([9, 2, 3, 4], 2) == [5]
    assert index.continuation([9, 9, 9], 2) == []
    snap = samples(rec.render().decode())
    assert value(snap, "d3d:shared_lookup_tokens") == 6  # the text and its end
    assert value(snap, "d3d:shared_lookup_lookups_total") == 2
    assert value(snap, "d3d:shared_lookup_found_total") == 1


def test_the_index_of_the_drafters_corpus_is_read_at_scrape_time():
    rec, index = MetricsRecorder("m", "async"), None
    rec.watch_copy_source(CORPUS, lambda: index)
    assert "d3d:corpus" not in rec.render().decode()  # none (off, or no corpus): no series
    index = CorpusIndex([[1, 2, 3, 4, 5]])
    assert index.continuation([9, 2, 3, 4], 2) == [5]
    assert index.continuation([9, 9, 9], 2) == []
    snap = samples(rec.render().decode())
    assert value(snap, "d3d:corpus_tokens") == 5
    assert value(snap, "d3d:corpus_lookups_total") == 2
    assert value(snap, "d3d:corpus_found_total") == 1


def test_memory_is_read_at_scrape_time():
    from sglang_d3d.engine.memory import MemoryReport

    rec, report = MetricsRecorder("m", "async"), None
    rec.watch_memory(lambda: report)
    assert "d3d:memory_bytes" not in rec.render().decode()  # loading: no series
    report = MemoryReport(target_weights=10, target_kv_cache=20, drafter_weights=3,
                          drafter_kv_cache=7)
    snap = samples(rec.render().decode())
    for part, nbytes in report.parts().items():
        assert value(snap, "d3d:memory_bytes", part=part) == nbytes


# ---- the live server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    # no guesses copied from the text (lookup_tokens 0): tiny models repeat themselves, and the
    # counts below follow every cycle drafting a block of 4 (copies: test_copy_cycles_counted)
    cfg = tiny_server_config(tiny_pair_dir, lookup_tokens=0)
    with ServerThread(create_app(cfg)) as s:
        yield s


def scrape(srv) -> str:
    r = httpx.get(f"{srv.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


@pytest.mark.slow
def test_every_design_metric_is_exported_with_labels(srv):
    text = scrape(srv)
    kinds = families(text)
    for name in HISTOGRAMS:
        assert kinds.get(f"d3d:{name}") == "histogram", name
    for name in COUNTERS:
        assert kinds.get(f"d3d:{name}") == "counter", name
    for name in GAUGES:
        assert kinds.get(f"d3d:{name}") == "gauge", name
    snap = samples(text)
    assert value(snap, "d3d:num_requests_running", model_name="tiny", mode="async") == 0
    # the loaded engine's weights and caches, by part
    assert value(snap, "d3d:memory_bytes", part="target_kv_cache") > 0
    assert value(snap, "d3d:memory_bytes", part="target_weights") > 0


@pytest.mark.slow
def test_counters_move_with_requests(srv):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    before = samples(scrape(srv))
    prompts = ["w5 w6 w7", "w30 w31", "w50 w51 w52 w53"]
    rs = [
        client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
        for p in prompts
    ]
    after = samples(scrape(srv))

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("d3d:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("d3d:generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    finished = [r.choices[0].finish_reason for r in rs]
    for reason in set(finished):
        assert delta("d3d:request_success_total", finish_reason=reason) == finished.count(reason)
    cycles = sum(r.model_extra["d3d"]["num_cycles"] for r in rs)
    assert delta("d3d:spec_accepted_length_count") == cycles
    assert delta("d3d:spec_num_drafts_total") == cycles  # async, batch of one: every cycle drafts
    assert delta("d3d:spec_num_draft_tokens_total") == 3 * cycles  # block 4 = 3 drafts
    assert delta("d3d:spec_branch_hits_total") + delta("d3d:spec_branch_misses_total") > 0
    assert delta("d3d:time_to_first_token_seconds_count") == len(rs)
    assert delta("d3d:e2e_request_latency_seconds_count") == len(rs)
    assert delta("d3d:request_queue_time_seconds_count") == len(rs)
    assert delta("d3d:spec_cycle_seconds_total") > 0
    # one request at a time: every engine cycle is one row-cycle, all of the fixed plan
    assert delta("d3d:spec_plan_cycles_total", block="4", predraft="true") == cycles
    assert delta("d3d:spec_plan_seconds_total") == pytest.approx(
        delta("d3d:spec_cycle_seconds_total"))


@pytest.mark.slow
def test_every_refusal_is_counted_by_reason(srv):
    url = f"{srv.url}/v1/completions"
    before = samples(scrape(srv))
    sends = {
        "too_long": {"prompt": "w5", "max_tokens": 10_000},
        "bad_request": {"prompt": "w5", "temperature": -1},
    }
    for body in sends.values():
        assert httpx.post(url, json=body).status_code == 400
    huge = b'{"prompt": "' + b"w5 " * (3 * 1024 * 1024) + b'"}'  # over the 8 MiB default
    r = httpx.post(url, content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    after = samples(scrape(srv))
    for reason in ("too_long", "bad_request", "body_too_large"):
        d = value(after, "d3d:request_rejected_total", reason=reason)
        assert d - value(before, "d3d:request_rejected_total", reason=reason) == 1, reason
    assert value(after, "d3d:request_rejected_total", reason="queue_full") == 0  # yet
    errors = value(after, "d3d:request_errors_total", type="invalid_request_error")
    assert errors - value(before, "d3d:request_errors_total", type="invalid_request_error") == 3


@pytest.mark.slow
def test_copy_cycles_counted(tiny_pair_dir):
    """The default server verifies runs copied from a repetitive greedy answer without a
    drafter pass, and says so in `d3d:spec_copy_cycles_total`."""
    with ServerThread(create_app(tiny_server_config(tiny_pair_dir))) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        before = samples(scrape(s))
        r = client.completions.create(model="tiny", prompt="w5 w6 w5 w6 w5 w6 w5", max_tokens=40,
                                      temperature=0)
        after = samples(scrape(s))
    copies = value(after, "d3d:spec_copy_cycles_total") - value(before, "d3d:spec_copy_cycles_total")
    drafts = value(after, "d3d:spec_num_drafts_total") - value(before, "d3d:spec_num_drafts_total")
    assert r.usage.completion_tokens == 40
    assert 0 < copies <= drafts
