"""What a serving benchmark reads from a server's /metrics: the speculation counters, totalled
before and after a load, turned into the load's figures (accepted length, branch hit rate, the
share of time decoding plainly, what each plan cost and yielded, by batch bucket, and why the
adaptive controller ran its speculative cycles)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sglang_d3d.speculative.cycle import Plan

# figure -> (counter sample, labels the sample must carry): what the speculation figures of a
# load are derived from, totalled over the samples that match
COUNTERS = {
    "accepted_sum": ("d3d:spec_accepted_length_sum", {}),
    "cycles": ("d3d:spec_accepted_length_count", {}),
    "hits": ("d3d:spec_branch_hits_total", {}),
    "misses": ("d3d:spec_branch_misses_total", {}),
    "busy_seconds": ("d3d:spec_plan_seconds_total", {}),
    "plain_seconds": ("d3d:spec_plan_seconds_total", {"block": "1"}),
}


def scrape(url: str, headers: dict | None = None) -> dict:
    """The server's totals of every figure in COUNTERS, and per plan under ("plan", name,
    "cycles" | "seconds"): name "4o" is block 4 with pre-drafting, "1" plain decoding."""
    text = httpx.get(f"{url}/metrics", timeout=30, headers=headers).text
    return counter_totals(list(text_string_to_metric_families(text)))


def counter_totals(families) -> dict:
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in families:
        for s in fam.samples:
            for key, (name, labels) in COUNTERS.items():
                if s.name == name and labels.items() <= s.labels.items():
                    out[key] += s.value
            part = PLAN_SAMPLES.get(s.name)
            if part is not None:
                for key in _plan_keys(s.labels, part):
                    out[key] = out.get(key, 0.0) + s.value
            if s.name == REASONS and s.labels["block"] != "1":
                key = ("why", int(s.labels["batch"]), _plan_name(s.labels), s.labels["reason"])
                out[key] = out.get(key, 0.0) + s.value
    return out


def _plan_keys(labels: dict, part: str) -> list[tuple]:
    """Where a plan sample adds up: ("plan", name, part) over every batch size, and
    ("plan_at", batch bucket, name, part) where the server labels the bucket."""
    name = _plan_name(labels)
    keys = [("plan", name, part)]
    if "batch" in labels:
        keys.append(("plan_at", int(labels["batch"]), name, part))
    return keys


# the controller's speculative cycles by why it chose them (estimate, warmup, explore)
REASONS = "d3d:controller_plan_cycles_total"
PLAN_SAMPLES = {"d3d:spec_plan_cycles_total": "cycles", "d3d:spec_plan_seconds_total": "seconds",
                "d3d:spec_plan_tokens_total": "tokens"}


def _plan_name(labels: dict) -> str:
    """The plan a `d3d:spec_plan_*` sample is labelled with, named as calibration names it."""
    return Plan.from_labels(labels["block"], labels.get("predraft") == "true").name


def spec_figures(before: dict, after: dict) -> dict:
    """Per load: accepted length, branch hit rate, the share of the engine's cycle time spent
    decoding plainly (the adaptive controller's fallback; 1.0 for ar), and per plan used, its
    cycles, their mean time and the tokens a cycle made (what the controller chose, what it
    cost, and what it gave)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    branches = d["hits"] + d["misses"]
    plans, by_batch = {}, {}
    for key, cycles in sorted((k, v) for k, v in d.items() if isinstance(k, tuple) and k[-1] == "cycles"):
        if cycles <= 0:
            continue
        cell = {"cycles": int(cycles), "mean_ms": 1e3 * d[(*key[:-1], "seconds")] / cycles}
        tokens = (*key[:-1], "tokens")
        if tokens in d:  # servers from before spec_plan_tokens do not report it
            cell["tokens_per_cycle"] = d[tokens] / cycles
        if key[0] == "plan":
            plans[key[1]] = cell
        else:  # ("plan_at", batch, name, "cycles")
            by_batch.setdefault(str(key[1]), {})[key[2]] = cell
    return {
        "mean_accepted_length": d["accepted_sum"] / d["cycles"] if d["cycles"] else None,
        "branch_hit_rate": d["hits"] / branches if branches else None,
        "plain_time_share": d["plain_seconds"] / d["busy_seconds"] if d["busy_seconds"] else None,
        "plans": plans,
        "plans_by_batch": by_batch,  # batch bucket -> plan -> cycles, mean_ms
        "speculated": speculated(d),
    }


def speculated(d: dict) -> dict:
    """The load's speculative cycles by why the controller ran them: batch bucket -> plan ->
    reason -> cycles (where the server reports it: what put a server speculating where it
    loses, its estimates or its measuring)."""
    out: dict = {}
    for (_, batch, plan, reason), n in sorted((k, v) for k, v in d.items()
                                               if isinstance(k, tuple) and k[0] == "why"):
        if n > 0:
            out.setdefault(str(batch), {}).setdefault(plan, {})[reason] = int(n)
    return out


def why_cells(speculated: dict) -> str:
    """'8o@4:estimate=2,warmup=1': per batch bucket and plan, its cycles by reason."""
    return " ".join(f"{plan}@{batch}:" + ",".join(f"{r}={n}" for r, n in reasons.items())
                    for batch, plans in speculated.items() for plan, reasons in plans.items())


def plan_cells(plans: dict) -> str:
    """'1:201@94(16.0) copy:27@142(31.6)': per plan its cycles, mean ms and, where the server
    reports it, the tokens a cycle made (all rows)."""
    return " ".join(f"{k}:{v['cycles']}@{v['mean_ms']:.0f}"
                    + (f"({v['tokens_per_cycle']:.1f})" if "tokens_per_cycle" in v else "")
                    for k, v in plans.items())
