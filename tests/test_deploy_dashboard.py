"""The Grafana dashboard against a real Prometheus scraping real servers.

Two `d3d serve` processes on loopback (mode async and mode ar, the same tiny random model
pair and served name, so the async-vs-ar panels have both sides), a real Prometheus (the
Debian `prometheus` binary) scraping both every second, some requests, and then every PromQL
expression in deploy/grafana/sglang-d3d.json through Prometheus's HTTP API, with the
dashboard variables substituted as Grafana would: each must parse, name only metrics the
servers export, and return finite data over the run.

D3D_DASHBOARD_PNG=docs/img/dashboard.png also plots the key panels from this run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml
from system_tools import require
from yamllint import linter
from yamllint.config import YamlLintConfig

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
SCRAPE_INTERVAL = 1.0
MODEL_NAME = "tiny"
MODES = ("async", "ar")
WAVE = 3  # concurrent requests per server
METRIC = re.compile(r"\bd3d:[a-zA-Z_:0-9]+")
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


panels = load_module("render_panels", GRAFANA / "render_panels.py")
builder = load_module("build_dashboard", GRAFANA / "build_dashboard.py")
DASHBOARD = panels.load_dashboard()


# ---- cheap checks of the files themselves ----


def test_dashboard_json_is_what_the_builder_writes():
    assert DASHBOARD == json.loads(json.dumps(builder.dashboard()))


def test_dashboard_variables_and_datasource():
    names = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert (
        names["datasource"]["type"] == "datasource" and names["datasource"]["query"] == "prometheus"
    )
    assert names["model_name"]["query"]["query"].startswith("label_values(")
    for p in DASHBOARD["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all("$model_name" in t["expr"] for t in p["targets"]), p["title"]


def test_every_metric_named_in_the_dashboard_is_in_the_design():
    design = (ROOT / "docs" / "design.md").read_text()
    documented = set(re.findall(r"`(d3d:[a-z0-9_]+)`", design))
    for q in panels.panel_queries(DASHBOARD):
        for name in METRIC.findall(q.expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert base in documented, f"{q.panel}: {name} is not in docs/design.md"


def test_prometheus_config_is_valid(tmp_path):
    promtool = require("promtool")
    conf = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    out = subprocess.run([promtool, "check", "config", str(conf)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "path",
    [
        "deploy/prometheus/prometheus.yml",
        "deploy/prometheus/alerts.yaml",
        "deploy/prometheus/alerts_test.yaml",
        "deploy/docker-compose.yml",
        "deploy/grafana/provisioning/datasources/prometheus.yml",
        "deploy/grafana/provisioning/dashboards/sglang-d3d.yml",
    ],
)
def test_monitoring_yaml_lints(path):
    conf = YamlLintConfig((ROOT / "deploy" / ".yamllint.yaml").read_text())
    problems = list(linter.run((ROOT / path).read_text(), conf))
    assert problems == [], [f"{p.line}:{p.column} {p.desc}" for p in problems]


def test_compose_wires_server_prometheus_and_grafana():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"server", "prometheus", "grafana"} <= services.keys()
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    port = services["server"]["command"][services["server"]["command"].index("--port") + 1]
    assert f"server:{port}" in targets


# ---- the real run ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if predicate():
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    import numpy as np

    from sglang_d3d.models.corpus import write_corpus
    from sglang_d3d.models.drafter import read_config
    from sglang_d3d.testing import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("tiny"))
    answers = [np.arange(3, 40) % 50, np.arange(7, 30)]  # any ids: its panel needs the series
    write_corpus(drafter, answers, read_config(Path(drafter)).target_fingerprint)
    return target, drafter


def start_server(mode: str, pair: tuple[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    target, drafter = pair
    # block size 4: the tiny drafter's block; max context within the tiny model's positions;
    # no guesses copied from the text (tiny models repeat themselves, and copies make trees
    # and cycles of copies win over pre-drafting): the drafter must draft and pre-draft for
    # every panel to have data.
    cmd = [str(ROOT / ".venv" / "bin" / "d3d"), "serve",
        "--target", target, "--drafter", drafter, "--mode", mode,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--block-size", "4", "--max-context", "256", "--lookup-tokens", "0",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, port


@pytest.fixture(scope="module")
def servers(tiny_pair, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    started = {m: start_server(m, tiny_pair, logs / f"{m}.log") for m in MODES}
    try:
        for mode, (proc, port) in started.items():
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda u=url: requests.get(f"{u}/health", timeout=2).status_code == 200,
                       180, f"{mode} server /health", proc)  # fmt: skip
        yield {m: f"http://127.0.0.1:{port}" for m, (_, port) in started.items()}
    finally:
        for proc, _ in started.values():
            stop(proc)
        for mode in MODES:
            print(
                f"--- {mode} server log (tail) ---\n" + (logs / f"{mode}.log").read_text()[-3000:]
            )


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """Checked before the servers start: without it there is nothing to scrape them with."""
    return require("prometheus")


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, servers, tmp_path_factory):
    binary = prometheus_binary
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = [url.removeprefix("http://") for url in servers.values()]
    conf = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL:g}s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "d3d", "static_configs": [{"targets": targets}]}],
        "rule_files": [str(ALERTS)],  # the shipped alerts, evaluated on the live servers
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(conf))
    port = free_port()
    cmd = [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=(tmp / "log").open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: requests.get(f"{base}/-/ready", timeout=2).ok, 60, "prometheus", proc)
        yield base
    finally:
        stop(proc)


def complete(url: str, i: int) -> None:
    prompt = " ".join(f"w{3 + (i * 7 + k) % 90}" for k in range(4 + i % 5))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24 + 8 * (i % 3), "temperature": 0}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, f"{url} request {i}: {r.text}"
    if i % WAVE == 0:  # one refusal per wave, for the refusal and error panels
        bad = requests.post(f"{url}/v1/completions", json={**body, "temperature": -1}, timeout=30)
        assert bad.status_code == 400, bad.text


def instant(prom: str, query: str) -> dict[str, float]:
    """mode (or "") -> value of an instant query."""
    result = panels.prom_get(prom, "query", query=query)["result"]
    return {s["metric"].get("mode", ""): float(s["value"][1]) for s in result}


def send_traffic(servers: dict[str, str], seconds: float) -> int:
    """Waves of WAVE concurrent requests per server, a second apart, for at least `seconds`
    (so every rate window of the run sees requests). Returns the requests sent per server."""
    deadline, sent = time.monotonic() + seconds, 0
    with ThreadPoolExecutor(max_workers=WAVE * len(servers)) as pool:
        while sent == 0 or time.monotonic() < deadline:
            jobs = [pool.submit(complete, url, sent + k) for url in servers.values()
                    for k in range(WAVE)]  # fmt: skip
            for j in jobs:
                j.result()
            sent += WAVE
            time.sleep(SCRAPE_INTERVAL)
    return sent


@pytest.fixture(scope="module")
def run(prometheus_binary, servers, prometheus):
    """Traffic on both servers once Prometheus scrapes them, then wait until it has it all
    (skipped before the servers start where there is no Prometheus)."""
    up = 'up{job="d3d"} == 1'
    wait_until(lambda: len(panels.prom_get(prometheus, "query", query=up)["result"]) == 2,
               30, "both targets up")  # fmt: skip
    time.sleep(2 * SCRAPE_INTERVAL)  # idle samples first: rates start from zero, as in real use
    start = time.time()
    sent = send_traffic(servers, float(os.environ.get("D3D_DASHBOARD_TRAFFIC_S", "8")))
    done = f'sum by (mode) (d3d:request_success_total{{model_name="{MODEL_NAME}"}})'
    want = dict.fromkeys(MODES, float(sent))
    wait_until(lambda: instant(prometheus, done) == want, 30, "scrapes of all requests")
    time.sleep(2 * SCRAPE_INTERVAL)
    window = panels.Window(start, time.time(), step=1.0, scrape_interval=SCRAPE_INTERVAL)
    variables = {"model_name": MODEL_NAME, "mode": "|".join(MODES), "datasource": "prometheus"}
    return prometheus, window, variables


def query_ids() -> list[str]:
    return [f"{q.panel} [{q.ref}]" for q in panels.panel_queries(DASHBOARD)]


@pytest.mark.slow
def test_variables_resolve_to_the_served_model_and_modes(run):
    prom, _, variables = run
    for name, query in panels.variable_queries(DASHBOARD).items():
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, query
        selector, label = m.group(1), m.group(2)
        selector = selector.replace("$model_name", variables["model_name"])
        values = panels.prom_get(prom, f"label/{label}/values", **{"match[]": selector})
        expected = {MODEL_NAME} if name == "model_name" else set(MODES)
        assert set(values) == expected, (name, values)


@pytest.mark.slow
def test_every_dashboard_metric_is_exported(run):
    prom, _, _ = run
    exported = set(panels.prom_get(prom, "label/__name__/values"))
    used = {name for q in panels.panel_queries(DASHBOARD) for name in METRIC.findall(q.expr)}
    assert used, "the dashboard names no d3d: metric"
    missing = sorted(used - exported)
    assert not missing, f"dashboard names metrics the servers do not export: {missing}"


@pytest.mark.slow
def test_the_alerts_evaluate_on_live_servers_and_read_exported_metrics(run):
    """The shipped alerting rules, loaded by the real Prometheus that scraped the servers:
    every rule evaluated without error, and every metric it reads is one the servers export
    (a misspelt name would evaluate cleanly to nothing)."""
    prom, _, _ = run
    exported = set(panels.prom_get(prom, "label/__name__/values"))
    (group,) = panels.prom_get(prom, "rules", type="alert")["groups"]
    assert group["rules"], "no alerting rule loaded"
    for rule in group["rules"]:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        missing = sorted(set(METRIC.findall(rule["query"])) - exported)
        assert not missing, f"{rule['name']} reads metrics the servers do not export: {missing}"
    assert {r["name"] for r in group["rules"]} == {
        r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}


# Ratios over drafts have no value in ar mode (0 / 0): their panels show async alone; nor is
# there an index of earlier requests' text or of a corpus in ar mode, nor a speculative plan
# for its controller to have run.
SPEC_ONLY = re.compile(
    r"d3d:spec_(num_draft_tokens|num_drafts|num_accepted_tokens|branch_hits|draft_time)"
    r"|d3d:shared_lookup_|d3d:corpus_|d3d:controller_plan_cycles"
)
# The test servers copy nothing (--lookup-tokens 0, see start_server), so nobody looks in the
# index of earlier requests' text or in the corpus (`tiny_pair` gives the drafter one): their
# shares found are 0 / 0. Its series must still exist (a
# misspelt name gives none), and its values are checked in tests/test_server_metrics.py.
NO_LOOKUPS = re.compile(r"d3d:(shared_lookup|corpus)_found_total")


def modes_with_data(result: list[dict]) -> set[str]:
    return {s["metric"].get("mode", "") for s in result if panels.finite_points(s)}


@pytest.mark.slow
@pytest.mark.parametrize("query", panels.panel_queries(DASHBOARD), ids=query_ids())
def test_panel_query_parses_and_returns_data(run, query):
    prom, window, variables = run
    expr = panels.expand(query.expr, variables, window)
    panels.prom_get(prom, "format_query", query=expr)  # parse only: fails with the parser's error
    result = panels.run_query(prom, query, expr, window)
    assert result, f"{query.panel}: no series for\n{expr}"
    if NO_LOOKUPS.search(query.expr):
        assert {s["metric"].get("mode") for s in result} == {"async"}, expr
        return
    modes = modes_with_data(result)
    assert modes, f"{query.panel}: only NaN/Inf values for\n{expr}"
    if "{{mode}}" in query.legend:  # a series per mode: both servers must show up
        expected = {"async"} if SPEC_ONLY.search(query.expr) else set(MODES)
        assert modes == expected, f"{query.panel}: data for modes {modes}\n{expr}"


@pytest.mark.slow
def test_a_metric_the_servers_do_not_export_gives_no_data(run):
    """The check above is not vacuous: a misspelt metric name comes back empty."""
    prom, window, variables = run
    q = panels.Query("probe", "A", 'sum(rate(d3d:spec_num_draft_token_total{model_name=~"$model_name"}'
                     "[$__rate_interval]))", "", False, "")  # fmt: skip
    assert panels.run_query(prom, q, panels.expand(q.expr, variables, window), window) == []


@pytest.mark.slow
def test_render_key_panels(run, tmp_path):
    """render_panels.py plots the same queries; D3D_DASHBOARD_PNG keeps the picture."""
    prom, window, variables = run
    out = ROOT / os.environ.get("D3D_DASHBOARD_PNG", tmp_path / "dashboard.png")
    panels.plot(prom, window, variables, out)
    assert out.stat().st_size > 20_000
