"""The alerting rules (deploy/prometheus/alerts.yaml), checked with Prometheus's own promtool:
the file loads, and each alert fires on series that should raise it and stays quiet on series
that should not (deploy/prometheus/alerts_test.yaml). The rules also run against live servers
in tests/test_deploy_dashboard.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from system_tools import require

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
METRIC = re.compile(r"\bd3d:[a-zA-Z_:0-9]+")


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = require("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, cwd=PROMETHEUS)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
            for r in g["rules"]]


def test_the_rules_load():
    out = promtool("check", "rules", "alerts.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_each_alert_fires_where_it_should_and_nowhere_else():
    out = promtool("test", "rules", "alerts_test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_unit_tested():
    tested = {t["alertname"] for case in yaml.safe_load(
        (PROMETHEUS / "alerts_test.yaml").read_text())["tests"] for t in case["alert_rule_test"]}
    assert {r["alert"] for r in rules()} == tested


def test_every_metric_an_alert_reads_is_in_the_design():
    documented = set(re.findall(r"`(d3d:[a-z0-9_]+)`", (ROOT / "docs" / "design.md").read_text()))
    for r in rules():
        for name in METRIC.findall(r["expr"]):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert base in documented, f"{r['alert']}: {name} is not in docs/design.md"


def test_every_alert_says_what_to_do():
    for r in rules():
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 80
