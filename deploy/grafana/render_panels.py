"""Plots the Grafana dashboard's key panels from a Prometheus, with matplotlib.

Grafana is not needed: the same PromQL as in sglang-d3d.json goes through Prometheus's HTTP
API (range queries, as Grafana sends them), with the dashboard variables substituted the way
Grafana substitutes them.

    .venv/bin/python deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 \
        --minutes 10 --out docs/img/dashboard.png

tests/test_deploy_dashboard.py imports the helpers here to run every dashboard query.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import requests

DASHBOARD = Path(__file__).resolve().parent / "sglang-d3d.json"
KEY_PANELS = (
    "Time to first token",
    "Inter-token latency",
    "Token throughput",
    "Running and waiting requests",
    "Accepted length per verify",
    "Draft acceptance rate",
    "Acceptance by draft position",
    "Branch hit rate (async)",
    "Draft, verify and cycle time (mean per cycle)",
    "Overlap fraction (drafter and target busy at once)",
    "Decoding plan (share of cycle time)",
    "Controller: estimated speedup over plain decoding",
    "Time per output token: async vs ar",
    "Decode speedup of async over ar (TPOT ar / async)",
)
# Grafana unit ids -> axis labels.
UNIT_LABELS = {"s": "seconds", "percentunit": "fraction", "reqps": "requests/s",
               "suffix: tok/s": "tokens/s", "x": "ratio", "none": ""}  # fmt: skip


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str
    legend: str
    instant: bool
    unit: str


@dataclass(frozen=True)
class Window:
    """What Grafana derives from the time picker: the range, the step and the rate window."""

    start: float
    end: float
    step: float = 1.0
    scrape_interval: float = 1.0

    @property
    def rate_interval(self) -> str:
        # Grafana: max($__interval + scrape interval, 4 * scrape interval).
        return f"{math.ceil(max(self.step + self.scrape_interval, 4 * self.scrape_interval))}s"

    @property
    def range(self) -> str:
        return f"{math.ceil(self.end - self.start)}s"


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panel_queries(dashboard: dict) -> list[Query]:
    out = []
    for p in dashboard["panels"]:
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for t in p.get("targets", []):
            out.append(
                Query(
                    p["title"],
                    t["refId"],
                    t["expr"],
                    t.get("legendFormat", ""),
                    bool(t.get("instant")),
                    unit,
                )  # fmt: skip
            )
    return out


def variable_queries(dashboard: dict) -> dict[str, str]:
    """name -> label_values(...) query of each query variable."""
    return {
        v["name"]: v["query"]["query"]
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    }


def expand(expr: str, variables: dict[str, str], window: Window) -> str:
    """Substitutes $name, ${name} and Grafana's built-ins, longest name first."""
    values = {**variables, "__rate_interval": window.rate_interval, "__range": window.range,
              "__interval": f"{math.ceil(window.step)}s"}  # fmt: skip
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    left = re.findall(r"\$\{?\w+", expr)
    if left:
        raise ValueError(f"unsubstituted variables {left} in {expr!r}")
    return expr


def prom_get(base: str, path: str, **params) -> dict:
    """GET a Prometheus API path; raises with Prometheus's own error text on failure."""
    r = requests.get(f"{base}/api/v1/{path}", params=params, timeout=30)
    body = r.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def run_query(base: str, q: Query, expr: str, window: Window) -> list[dict]:
    """Series of one panel query, as Grafana would fetch them (range, or instant at the end)."""
    if q.instant:
        return prom_get(base, "query", query=expr, time=window.end)["result"]
    data = prom_get(base, "query_range", query=expr, start=window.start, end=window.end,
                    step=window.step)  # fmt: skip
    return data["result"]


def finite_points(series: dict) -> list[tuple[float, float]]:
    points = series.get("values") or [series["value"]]
    return [(float(t), float(v)) for t, v in points if math.isfinite(float(v))]


def legend(q: Query, metric: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), q.legend) or q.ref


def plot(base: str, window: Window, variables: dict[str, str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queries = [q for q in panel_queries(load_dashboard()) if q.panel in KEY_PANELS]
    titles = [t for t in KEY_PANELS if any(q.panel == t for q in queries)]
    cols = 3
    fig, axes = plt.subplots(
        math.ceil(len(titles) / cols), cols, figsize=(18, 3.4 * len(titles) / cols)
    )
    for ax, title in zip(axes.flat, titles, strict=False):
        for q in (q for q in queries if q.panel == title):
            draw(ax, q, run_query(base, q, expand(q.expr, variables, window), window), window)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    fig.suptitle("sglang-d3d dashboard (PromQL from deploy/grafana/sglang-d3d.json)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def draw(ax, q: Query, result: list[dict], window: Window) -> None:
    if q.instant:  # a bar per series (the per-position panel)
        rows = sorted(((legend(q, s["metric"]), finite_points(s)) for s in result),
                      key=lambda r: (len(r[0]), r[0]))  # fmt: skip
        rows = [(name, pts[0][1]) for name, pts in rows if pts]
        ax.bar([r[0] for r in rows], [r[1] for r in rows])
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        return
    for s in result:
        pts = finite_points(s)
        if pts:
            ax.plot([t - window.start for t, _ in pts], [v for _, v in pts],
                    label=f"{legend(q, s['metric'])}", lw=1.2)  # fmt: skip
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel(UNIT_LABELS.get(q.unit, q.unit), fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=10.0, help="window ending now")
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    ap.add_argument("--model-name", default=".*")
    ap.add_argument("--mode", default=".*")
    ap.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    a = ap.parse_args()
    end = time.time()
    window = Window(end - 60 * a.minutes, end, a.step, a.scrape_interval)
    plot(a.prometheus, window, {"model_name": a.model_name, "mode": a.mode}, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
