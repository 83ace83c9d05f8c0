"""Writes sglang-d3d.json, the Grafana dashboard, from the panel list below.

The JSON is generated so that every query is written once, with the same selector and the
same metric names as docs/design.md (section Metrics). Run after editing:

    .venv/bin/python deploy/grafana/build_dashboard.py

tests/test_deploy_dashboard.py runs every query against a real Prometheus scraping the real
server, and checks that the committed JSON is what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "sglang-d3d.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model_name=~"$model_name", mode=~"$mode"'
# The async-vs-ar panels compare modes, so they ignore the $mode filter.
SEL_ALL_MODES = 'model_name=~"$model_name"'
QUANTILES = (0.5, 0.9, 0.99)


def rate(metric: str, sel: str = SEL, window: str = "$__rate_interval") -> str:
    return f"rate({metric}{{{sel}}}[{window}])"


def ratio(num: str, den: str, by: str = "mode", sel: str = SEL) -> str:
    """Rate of one counter over another, per `by` group (e.g. tokens accepted per drafted)."""
    return f"sum by ({by}) ({rate(num, sel)})\n/\nsum by ({by}) ({rate(den, sel)})"


def mean(histogram: str, sel: str = SEL) -> str:
    """Mean observation of a histogram over the rate window: rate(_sum) / rate(_count)."""
    return ratio(f"{histogram}_sum", f"{histogram}_count", sel=sel)


def quantile_targets(histogram: str) -> list[dict]:
    return [
        target(
            f"histogram_quantile({q}, sum by (le, mode) ({rate(histogram + '_bucket')}))",
            f"p{round(q * 100)} {{{{mode}}}}",
        )
        for q in QUANTILES
    ]


def target(expr: str, legend: str, instant: bool = False) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "range": not instant}
    if instant:
        t["instant"] = True
    return t


def panel(title: str, targets: list[dict], unit: str, kind: str = "timeseries", **opts) -> dict:
    for ref, t in zip("ABCDEFGH", targets, strict=False):
        t["refId"] = ref
    defaults: dict = {"unit": unit}
    defaults.update(opts.pop("defaults", {}))
    return {
        "type": kind,
        "title": title,
        "description": opts.pop("description", ""),
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": opts.pop("overrides", [])},
        "options": opts.pop("options", {"legend": {"displayMode": "list", "placement": "bottom"}}),
        **opts,
    }


def latency_panels() -> list[dict]:
    return [
        panel("Time to first token", quantile_targets("d3d:time_to_first_token_seconds"), "s"),
        panel("Inter-token latency", quantile_targets("d3d:inter_token_latency_seconds"), "s"),
        panel(
            "End-to-end request latency", quantile_targets("d3d:e2e_request_latency_seconds"), "s"
        ),
        panel("Queue time", quantile_targets("d3d:request_queue_time_seconds"), "s"),
    ]


def load_panels() -> list[dict]:
    requests = target(
        f"sum by (mode, finish_reason) ({rate('d3d:request_success_total')})",
        "{{mode}} {{finish_reason}}",
    )
    tokens = [
        target(f"sum by (mode) ({rate('d3d:generation_tokens_total')})", "generated {{mode}}"),
        target(f"sum by (mode) ({rate('d3d:prompt_tokens_total')})", "prompt {{mode}}"),
    ]
    queue = [
        target(f"sum by (mode) (d3d:num_requests_running{{{SEL}}})", "running {{mode}}"),
        target(f"sum by (mode) (d3d:num_requests_waiting{{{SEL}}})", "waiting {{mode}}"),
    ]
    return [
        panel("Request throughput", [requests], "reqps"),
        panel("Token throughput", tokens, "suffix: tok/s"),
        panel("Running and waiting requests", queue, "none"),
    ]


def refusal_panels() -> list[dict]:
    """Requests that got no answer: refusals before generation (a reason each), and every
    error response by OpenAI error type and HTTP status."""
    rejected = target(
        f"sum by (mode, reason) ({rate('d3d:request_rejected_total')})", "{{mode}} {{reason}}"
    )
    errors = target(
        f"sum by (mode, type, status) ({rate('d3d:request_errors_total')})",
        "{{mode}} {{status}} {{type}}",
    )
    return [
        panel("Refused requests by reason", [rejected], "reqps",
              description="queue_full (503), too_long, bad_request, body_too_large (413), "
              "unauthorized (401), unavailable (loading or draining)."),
        panel("Error responses by type", [errors], "reqps"),
    ]  # fmt: skip


def speculation_panels() -> list[dict]:
    # No histogram_quantile here: it interpolates linearly inside a bucket starting from 0, so
    # integer lengths that are all 1 would read as p50 = 0.5. Means are exact.
    accepted_len = [
        target(mean("d3d:spec_accepted_length"), "mean {{mode}}"),
        # Spec cycles only (the histogram also counts target-only cycles, at length 1).
        target(
            f"1 + {ratio('d3d:spec_num_accepted_tokens_total', 'd3d:spec_num_drafts_total')}",
            "1 + accepted / drafts {{mode}}",
        ),
    ]
    acceptance = target(
        ratio("d3d:spec_num_accepted_tokens_total", "d3d:spec_num_draft_tokens_total"),
        "{{mode}}",
    )
    per_pos = target(
        "sum by (mode, position) (increase(d3d:spec_num_accepted_tokens_per_pos_total"
        f"{{{SEL}}}[$__range]))\n/ ignoring(position) group_left\n"
        f"sum by (mode) (increase(d3d:spec_num_drafts_total{{{SEL}}}[$__range]))",
        "{{mode}} pos {{position}}",
        instant=True,
    )
    hits = rate("d3d:spec_branch_hits_total")
    misses = rate("d3d:spec_branch_misses_total")
    branch = target(
        f"sum by (mode) ({hits})\n/\n(sum by (mode) ({hits}) + sum by (mode) ({misses}))",
        "{{mode}}",
    )
    trees = target(ratio("d3d:spec_tree_cycles_total", "d3d:spec_num_drafts_total"),
                   "trees {{mode}}")
    copies = target(ratio("d3d:spec_copy_cycles_total", "d3d:spec_num_drafts_total"),
                    "copies {{mode}}")
    sources = (("d3d:shared_lookup", "earlier requests"), ("d3d:corpus", "corpus"))
    found = [target(ratio(f"{m}_found_total", f"{m}_lookups_total"), f"{name} {{{{mode}}}}")
             for m, name in sources]
    held = [target(f"sum by (mode) ({m}_tokens{{{SEL}}})", f"{name} tokens {{{{mode}}}}")
            for m, name in sources]
    unit_ratio = {"defaults": {"min": 0, "max": 1}}
    return [
        panel(
            "Accepted length per verify",
            accepted_len,
            "none",
            description="Tokens gained per target verify pass (accepted drafts + 1).",
        ),
        panel("Draft acceptance rate", [acceptance], "percentunit", **unit_ratio),
        panel(
            "Acceptance by draft position",
            [per_pos],
            "percentunit",
            kind="bargauge",
            options={"orientation": "vertical", "displayMode": "gradient"},
            **unit_ratio,
            description="Share of verify cycles that accepted the draft at each position.",
        ),
        panel(
            "Branch hit rate (async)",
            [branch],
            "percentunit",
            **unit_ratio,
            description="Share of cycles whose pre-drafted branch matched the verify outcome.",
        ),
        panel(
            "Verified as token trees / copies",
            [trees, copies],
            "percentunit",
            **unit_ratio,
            description="Share of speculative cycles whose drafts went to the target as a "
            "token tree (cycles without pre-drafting; --tree-nodes), and of those whose drafts "
            "were copied from the request's own text, or an earlier request's, with no drafter "
            "pass (--copy-ngram, --shared-lookup-tokens).",
        ),
        panel(
            "Copies from other text",
            found + held,
            "percentunit",
            defaults={"min": 0},
            description="Of the greedy requests with no copy in their own text that looked in "
            "finished requests' prompts and answers (--shared-lookup-tokens), and then in the "
            "drafter's corpus of the target's own answers (--corpus-tokens), the share that "
            "found one (left axis), and the tokens each holds (right axis). Empty where off "
            "(0, ar mode, a drafter without corpus.npz).",
            overrides=[{"matcher": {"id": "byRegexp", "options": ".* tokens .*"},
                        "properties": [{"id": "unit", "value": "none"},
                                       {"id": "custom.axisPlacement", "value": "right"}]}],
        ),
    ]


def timing_panels() -> list[dict]:
    times = [
        target(mean("d3d:spec_draft_time_seconds"), "draft {{mode}}"),
        target(mean("d3d:spec_verify_time_seconds"), "verify {{mode}}"),
        target(mean("d3d:spec_cycle_time_seconds"), "cycle {{mode}}"),
        target(
            f"histogram_quantile(0.99, sum by (le, mode) ({rate('d3d:spec_cycle_time_seconds_bucket')}))",
            "cycle p99 {{mode}}",
        ),
    ]
    overlap = [
        target(
            ratio("d3d:spec_overlap_seconds_total", "d3d:spec_cycle_seconds_total"),
            "time-weighted {{mode}}",
        ),
        target(mean("d3d:spec_overlap_fraction"), "per-cycle mean {{mode}}"),
    ]
    return [
        panel("Draft, verify and cycle time (mean per cycle)", times, "s"),
        panel(
            "Overlap fraction (drafter and target busy at once)",
            overlap,
            "percentunit",
            defaults={"min": 0, "max": 1},
        ),
    ]


def controller_panels() -> list[dict]:
    plan = "mode, block, predraft"
    share = target(
        f"sum by ({plan}) ({rate('d3d:spec_plan_seconds_total')})\n"
        "/ ignoring(block, predraft) group_left\n"
        f"sum by (mode) ({rate('d3d:spec_plan_seconds_total')})",
        "{{mode}} block {{block}} predraft {{predraft}}",
    )
    by_batch = "mode, batch, block, predraft"
    cost = target(
        f"sum by ({by_batch}) ({rate('d3d:spec_plan_seconds_total')})\n"
        f"/ sum by ({by_batch}) ({rate('d3d:spec_plan_cycles_total')})",
        "{{mode}} batch {{batch}} block {{block}} predraft {{predraft}}",
    )
    served = target(
        f"sum by ({by_batch}) ({rate('d3d:spec_plan_tokens_total')})\n"
        f"/ sum by ({by_batch}) ({rate('d3d:spec_plan_seconds_total')})",
        "{{mode}} batch {{batch}} block {{block}} predraft {{predraft}}",
    )
    speculative = SEL + ', block!="1"'
    why = target(
        f"sum by (mode, batch, block, reason) ({rate('d3d:controller_plan_cycles_total', speculative)})",
        "{{mode}} batch {{batch}} block {{block}} {{reason}}",
    )
    speedup = target(
        f"max by (mode, batch, block, predraft) (d3d:controller_tokens_per_second{{{SEL}}})\n"
        "/ ignoring(block, predraft) group_left\n"
        f'max by (mode, batch) (d3d:controller_tokens_per_second{{{SEL}, block="1"}})',
        "{{mode}} batch {{batch}} block {{block}} predraft {{predraft}}",
    )
    return [
        panel(
            "Decoding plan (share of cycle time)",
            [share],
            "percentunit",
            defaults={"min": 0, "max": 1},
            description="What the adaptive controller ran: block 1 is plain decoding, "
            "predraft = drafting the next block while the target verifies; block copy = "
            "cycles that verified copies from the text with no drafter pass (nobody's plan).",
        ),
        panel(
            "Controller: estimated speedup over plain decoding",
            [speedup],
            "x",
            description="Per batch-size bucket (powers of two): the controller's estimated "
            "tokens/s of each plan over plain decoding's. It runs the highest; below 1 it "
            "decodes plainly, re-measuring a losing plan now and then.",
        ),
        panel(
            "Cycle time by plan and batch size (served)",
            [cost],
            "s",
            description="Mean served cycle of each plan at each batch-size bucket (4 = 4-7 "
            "requests decoding): what the controller's choices cost, beside its estimates.",
        ),
        panel(
            "Why the controller speculated (cycles/s)",
            [why],
            "short",
            description="Speculative cycles the controller ran, by batch-size bucket, block "
            "and reason: estimate (its estimates put the plan ahead of plain decoding), warmup "
            "(the plan was still being measured at that bucket) or explore (re-measured in "
            "turn). Speculation where it loses, with reason estimate, means wrong estimates.",
        ),
        panel(
            "Served tokens/s by plan and batch size",
            [served],
            "short",
            description="Tokens the engine produced per second of each plan's cycles, at each "
            "batch-size bucket: what each plan delivered, to read beside the controller's "
            "estimates (block 1 is plain decoding, block copy cycles of copies).",
        ),
    ]


def tpot(by: str, sel: str) -> str:
    """Time per output token: the gaps between deliveries over the tokens after the first.

    ITL is observed once per delivery, and a speculative cycle delivers several tokens at
    once, so mean ITL alone would flatter ar; dividing by tokens makes modes comparable.
    """
    gaps = f"sum by ({by}) ({rate('d3d:inter_token_latency_seconds_sum', sel)})"
    tokens = f"sum by ({by}) ({rate('d3d:generation_tokens_total', sel)})"
    firsts = f"sum by ({by}) ({rate('d3d:time_to_first_token_seconds_count', sel)})"
    return f"{gaps}\n/\n({tokens} - {firsts})"


def mode_panels() -> list[dict]:
    per_mode = target(tpot("mode", SEL_ALL_MODES), "{{mode}}")
    e2e = target(mean("d3d:e2e_request_latency_seconds", SEL_ALL_MODES), "{{mode}}")
    ar, spec = (f'{SEL_ALL_MODES}, mode="{m}"' for m in ("ar", "async"))
    speedup = target(
        f"({tpot('model_name', ar)})\n/\n({tpot('model_name', spec)})",
        "{{model_name}}",
    )
    return [
        panel("Time per output token: async vs ar", [per_mode], "s"),
        panel("Mean end-to-end latency: async vs ar", [e2e], "s"),
        panel(
            "Decode speedup of async over ar (TPOT ar / async)",
            [speedup],
            "x",
            description="Needs servers in both modes scraped with the same model_name.",
        ),
    ]


def layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    """Places rows of panels on Grafana's 24-column grid and numbers them."""
    out, y, next_id = [], 0, 1
    for title, panels in rows:
        out.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "id": next_id,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        width = 24 // min(len(panels), 4)
        for i, p in enumerate(panels):
            p["id"], next_id = next_id, next_id + 1
            p["gridPos"] = {"h": 8, "w": width, "x": (i % 4) * width, "y": y + (i // 4) * 8}
            out.append(p)
        y += 8 * ((len(panels) + 3) // 4)
    return out


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "refresh": 2,
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def templating() -> dict:
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }
    return {
        "list": [
            datasource,
            variable("model_name", "Model", "label_values(d3d:num_requests_running, model_name)"),
            variable(
                "mode",
                "Mode",
                'label_values(d3d:num_requests_running{model_name=~"$model_name"}, mode)',
            ),
        ]
    }


def dashboard() -> dict:
    rows = [
        ("Latency", latency_panels()),
        ("Throughput and load", load_panels()),
        ("Refusals and errors", refusal_panels()),
        ("Speculation quality", speculation_panels()),
        ("Draft / verify timing", timing_panels()),
        ("Adaptive controller", controller_panels()),
        ("async vs ar", mode_panels()),
    ]
    return {
        "uid": "sglang-d3d",
        "title": "sglang-d3d: D3D speculative decoding",
        "tags": ["sglang-d3d", "llm", "speculative-decoding"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "templating": templating(),
        "panels": layout(rows),
    }


def main() -> None:
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
