"""Prometheus metrics for serving and speculation (names: docs/design.md, section Metrics).

The engine fills one `CycleStats` per request per verify cycle and one `RequestStats` per
request; this recorder only turns those (and the server's request timings) into metrics, on a
registry of its own. Ratios are left to PromQL (rates of counters, so they stay correct over any
window and across restarts):

Acceptance rate (share of draft tokens the target accepted)::

    sum(rate(d3d:spec_num_accepted_tokens_total[5m])) by (model_name, mode)
      / sum(rate(d3d:spec_num_draft_tokens_total[5m])) by (model_name, mode)

Mean acceptance length (tokens gained per verify pass, the target's own token included)::

    1 + sum(rate(d3d:spec_num_accepted_tokens_total[5m])) by (model_name, mode)
      / sum(rate(d3d:spec_num_drafts_total[5m])) by (model_name, mode)

  (or, from the histogram: rate(d3d:spec_accepted_length_sum[5m])
  / rate(d3d:spec_accepted_length_count[5m]), which also counts target-only cycles)

Per-position acceptance (how deep into the block drafts survive)::

    rate(d3d:spec_num_accepted_tokens_per_pos_total[5m])
      / ignoring(position) group_left rate(d3d:spec_num_drafts_total[5m])

Branch hit rate (async mode: share of cycles whose pre-drafted branch matched)::

    sum(rate(d3d:spec_branch_hits_total[5m])) by (model_name, mode)
      / (sum(rate(d3d:spec_branch_hits_total[5m])) by (model_name, mode)
         + sum(rate(d3d:spec_branch_misses_total[5m])) by (model_name, mode))

Share of decoding time by cycle plan (block 1: plain decoding; the adaptive controller's
choice, engine/adaptive.py; block "copy": cycles that verified copies from the text without a
drafter pass, nobody's plan)::

    sum by (block, predraft) (rate(d3d:spec_plan_seconds_total[5m]))
      / ignoring(block, predraft) group_left sum(rate(d3d:spec_plan_seconds_total[5m]))

The controller's own estimates are gauges read at scrape time: `d3d:controller_cycle_seconds`
and `d3d:controller_tokens_per_second` (labels `batch`, the power-of-two bucket, `block`,
`predraft`), and `d3d:controller_accept_rate` (label `position`). Why it ran each plan is a
counter read the same way, `d3d:controller_plan_cycles_total` (labels `batch`, `block`,
`predraft`, `reason`: estimate, warmup or explore). Share of speculative cycles that were
warm-ups or re-measurements::

    sum by (mode) (rate(d3d:controller_plan_cycles_total{block!="1", reason!="estimate"}[5m]))
      / sum by (mode) (rate(d3d:controller_plan_cycles_total{block!="1"}[5m]))

Overlap fraction over a window::

    rate(d3d:spec_overlap_seconds_total[5m]) / rate(d3d:spec_cycle_seconds_total[5m])

Share of requests refused (any reason), and error responses per second by type::

    sum(rate(d3d:request_rejected_total[5m])) by (model_name)
      / (sum(rate(d3d:request_rejected_total[5m])) by (model_name)
         + sum(rate(d3d:request_success_total[5m])) by (model_name))
    sum(rate(d3d:request_errors_total[5m])) by (type)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sglang_d3d.server.errors import rejection_reason

from sglang_d3d.engine.adaptive import bucket
from sglang_d3d.speculative.stats import CycleStats, RequestStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name", "mode")
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LENGTH_BUCKETS = tuple(range(1, 17)) + (20, 24, 32, 48, 64)
FRACTION_BUCKETS = tuple(i / 10 for i in range(11))
# Every refusal has a reason (server/errors.py rejection_reason); all start at zero.
REJECT_REASONS = (
    "queue_full", "too_long", "bad_request", "body_too_large", "unauthorized", "unavailable",
)  # fmt: skip


class MetricsRecorder:
    def __init__(self, model_name: str, mode: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._labels = {"model_name": model_name, "mode": mode}
        self._make_histograms()
        self._make_counters()
        self._running = self._gauge("num_requests_running", "Requests in the running batch.")
        self._waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")

    # ---- construction: every metric is bound to this server's labels once ----

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        m = Histogram(f"d3d:{name}", doc, LABELS, registry=self.registry, buckets=buckets)
        return m.labels(**self._labels)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        m = Counter(f"d3d:{name}", doc, LABELS + extra, registry=self.registry)
        return m if extra else m.labels(**self._labels)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"d3d:{name}", doc, LABELS, registry=self.registry).labels(**self._labels)

    def _make_histograms(self) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = h(
            "inter_token_latency_seconds",
            "Gap between consecutive token deliveries of a request (one per engine emit).",
            LATENCY_BUCKETS,
        )
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Submit to prefill start.", LATENCY_BUCKETS)
        self.accepted_length = h(
            "spec_accepted_length", "Tokens gained per verify pass.", LENGTH_BUCKETS
        )
        self.draft_time = h("spec_draft_time_seconds", "Drafter time per cycle.", STEP_BUCKETS)
        self.verify_time = h("spec_verify_time_seconds", "Target verify pass.", STEP_BUCKETS)
        self.cycle_time = h("spec_cycle_time_seconds", "Wall time of a cycle.", STEP_BUCKETS)
        self.overlap_fraction = h(
            "spec_overlap_fraction",
            "Share of a cycle with drafter and target running at once.",
            FRACTION_BUCKETS,
        )

    def _make_counters(self) -> None:
        c = self._counter
        self.num_drafts = c("spec_num_drafts", "Verify cycles that carried drafts.")
        self.num_draft_tokens = c("spec_num_draft_tokens", "Draft tokens sent to the target.")
        self.num_accepted = c("spec_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_pos = c(
            "spec_num_accepted_tokens_per_pos", "Accepted drafts by position.", ("position",)
        )
        self.tree_cycles = c("spec_tree_cycles", "Verify cycles whose drafts went as a token tree.")
        self.copy_cycles = c("spec_copy_cycles", "Verify cycles whose drafts were copied from the "
                             "request's own text, with no drafter pass.")
        self.branch_hits = c("spec_branch_hits", "Cycles whose pre-drafted branch matched.")
        self.branch_misses = c("spec_branch_misses", "Cycles whose pre-drafted branches missed.")
        self.overlap_seconds = c("spec_overlap_seconds", "Drafter/target overlap time.")
        self.cycle_seconds = c("spec_cycle_seconds", "Total cycle wall time.")
        # batch: the power-of-two bucket of the cycle's rows (4: 4-7), as the controller's
        # estimates are labelled, so what each plan cost can be read at one load level
        plan = ("block", "predraft", "batch")
        self.plan_cycles = c("spec_plan_cycles", "Engine cycles by plan (block 1: plain) and "
                             "batch-size bucket.", plan)
        self.plan_seconds = c("spec_plan_seconds", "Engine cycle time by plan and batch-size "
                              "bucket.", plan)
        # with plan_seconds: the tokens/s each plan served, beside the controller's estimate
        self.plan_tokens = c("spec_plan_tokens", "Tokens produced by engine cycles, by plan and "
                             "batch-size bucket.", plan)
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.request_success = c(
            "request_success", "Finished requests by finish reason.", ("finish_reason",)
        )
        self.request_rejected = c(
            "request_rejected", "Requests refused before generation, by reason.", ("reason",)
        )
        for reason in REJECT_REASONS:
            self.request_rejected.labels(**self._labels, reason=reason)
        self.request_errors = c(
            "request_errors",
            "Error responses (and errors sent inside a stream) by OpenAI error type and status.",
            ("type", "status"),
        )

    # ---- feeding ----

    def on_cycle(self, request_id: str, c: CycleStats) -> None:
        """Cycle listener: called on the engine's loop thread (prometheus_client is thread-safe)."""
        self.accepted_length.observe(c.accepted_length)
        self.verify_time.observe(c.verify_time)
        self.cycle_time.observe(c.cycle_time)
        self.cycle_seconds.inc(c.cycle_time)
        self.overlap_seconds.inc(c.overlap_time)
        if c.cycle_time > 0:
            self.overlap_fraction.observe(min(1.0, c.overlap_time / c.cycle_time))
        if c.num_drafts > 0:
            self.draft_time.observe(c.draft_time)
            self.num_drafts.inc()
            self.num_draft_tokens.inc(c.num_drafts)
            self.num_accepted.inc(c.num_accepted)
            for pos in range(c.num_accepted):
                self.accepted_per_pos.labels(**self._labels, position=str(pos)).inc()
            if c.tree_nodes > 0:
                self.tree_cycles.inc()
            if c.copied:
                self.copy_cycles.inc()
        if c.branch_hit is True:
            self.branch_hits.inc()
        elif c.branch_hit is False:
            self.branch_misses.inc()

    def on_plan(self, batch: int, plan: Any, seconds: float, tokens: int) -> None:
        """Plan listener: one engine cycle of `plan` (speculative/cycle.py Plan) for `batch`
        requests that took `seconds` and produced `tokens`, on the engine's loop thread."""
        labels = {**self._labels, "block": plan.block_label, "predraft": _flag(plan.overlap),
                  "batch": str(bucket(batch))}
        self.plan_cycles.labels(**labels).inc()
        self.plan_seconds.labels(**labels).inc(seconds)
        self.plan_tokens.labels(**labels).inc(tokens)

    def watch_controller(self, source: Callable[[], Any]) -> None:
        """Export the adaptive controller's estimates at every scrape; source() returns the
        controller, or None while there is none (loading, ar mode, the SGLang backend)."""
        self.registry.register(ControllerCollector(source, self._labels))

    def watch_memory(self, source: Callable[[], Any]) -> None:
        """Export what the engine's weights and caches hold; source() returns the engine's
        MemoryReport, or None (loading, or the SGLang backend)."""
        from sglang_d3d.server.memory_metrics import MemoryCollector

        self.registry.register(MemoryCollector(source, self._labels))

    def watch_copy_source(self, names: CopySourceMetrics, source: Callable[[], Any]) -> None:
        """Export a source of copies at every scrape (`SHARED_TEXT`, `CORPUS`); source()
        returns it, or None while there is none (loading, off, ar mode, the SGLang backend)."""
        self.registry.register(CopySourceCollector(names, source, self._labels))

    def on_error(self, status: int, type: str, code: str | None) -> None:
        """An error response: counted by type, and as a rejection when it is one."""
        self.request_errors.labels(**self._labels, type=type, status=str(status)).inc()
        reason = rejection_reason(status, code)
        if reason is not None:
            self.request_rejected.labels(**self._labels, reason=reason).inc()

    def track(self, arrival: float, prompt_tokens: int) -> RequestTracker:
        """Start timing an admitted request (arrival: time.monotonic() at receipt)."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTracker(self, arrival)

    def set_queue_sizes(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ControllerCollector:
    """The controller's estimates as gauges, read when Prometheus scrapes: what each plan's
    cycle costs and yields per batch-size bucket, and the per-position acceptance it plans
    with; and the cycles it ran of each plan, by why it chose it. Grafana shows why the server
    speculates, or has fallen back to plain decoding."""

    def __init__(self, source: Callable[[], Any], labels: dict[str, str]) -> None:
        self._source, self._labels = source, labels

    def describe(self) -> list:
        return []  # names are known only once the controller exists; nothing to clash with

    def collect(self):
        ctl = self._source()
        if ctl is None:
            return
        keys = [*self._labels, "batch", "block", "predraft"]
        seconds = GaugeMetricFamily(
            "d3d:controller_cycle_seconds", "Estimated cycle time by plan and batch bucket.",
            labels=keys)
        speed = GaugeMetricFamily(
            "d3d:controller_tokens_per_second",
            "Estimated tokens/s by plan and batch bucket (the controller picks the highest).",
            labels=keys)
        for batch, plan, secs, tps in ctl.snapshot():
            values = [*self._labels.values(), str(batch), str(plan.block), _flag(plan.overlap)]
            seconds.add_metric(values, secs)
            speed.add_metric(values, tps)
        rates = GaugeMetricFamily(
            "d3d:controller_accept_rate",
            "P(draft accepted | the drafts before it were), as the controller estimates it.",
            labels=[*self._labels, "position"])
        for i, r in enumerate(ctl.accept_rates()):
            rates.add_metric([*self._labels.values(), str(i)], r)
        yield from (seconds, speed, rates, self._reasons(ctl, keys))

    def _reasons(self, ctl: Any, keys: list[str]) -> CounterMetricFamily:
        ran = CounterMetricFamily(
            "d3d:controller_plan_cycles",
            "Cycles the controller ran of each plan by batch bucket and why it chose it: "
            "estimate (best on its estimates), warmup (still being measured) or explore "
            "(re-measured in turn).", labels=[*keys, "reason"])
        for (batch, plan, reason), n in ctl.reasons():
            ran.add_metric([*self._labels.values(), str(batch), str(plan.block),
                            _flag(plan.overlap), reason], n)
        return ran


@dataclass(frozen=True)
class CopySourceMetrics:
    """The metrics of a source of copies other than a request's own text: `{prefix}_tokens`
    (held), `{prefix}_lookups` and `{prefix}_found` (counters), with their help texts."""

    prefix: str
    held: str
    looked: str


SHARED_TEXT = CopySourceMetrics(
    "d3d:shared_lookup", "Tokens of finished requests' text held for copies.",
    "Greedy rows without a copy of their own that looked in earlier requests' text.")
CORPUS = CopySourceMetrics(
    "d3d:corpus", "Tokens of the drafter's corpus (the target's own answers) indexed for copies.",
    "Greedy rows without a copy in their own or earlier requests' text that looked in the "
    "drafter's corpus.")


class CopySourceCollector:
    """A source of copies (speculative/shared_lookup.py: earlier requests' text;
    speculative/corpus_lookup.py: the drafter's corpus), read at scrape time: the tokens it
    holds, and how often a greedy row looked there and found a copy (the share found is what
    the source buys)."""

    def __init__(self, names: CopySourceMetrics, source: Callable[[], Any],
                 labels: dict[str, str]) -> None:
        self._names, self._source, self._labels = names, source, labels

    def describe(self) -> list:
        return []

    def collect(self):
        index = self._source()
        if index is None:
            return
        n, keys, values = self._names, list(self._labels), list(self._labels.values())
        held = GaugeMetricFamily(f"{n.prefix}_tokens", n.held, labels=keys)
        held.add_metric(values, len(index))
        looked = CounterMetricFamily(f"{n.prefix}_lookups", n.looked, labels=keys)
        looked.add_metric(values, index.lookups)
        found = CounterMetricFamily(f"{n.prefix}_found", "Those lookups that found a copy.",
                                    labels=keys)
        found.add_metric(values, index.found)
        yield from (held, looked, found)


def _flag(value: bool) -> str:
    return "true" if value else "false"


class RequestTracker:
    """Latency bookkeeping of one request; owned by the coroutine serving it."""

    def __init__(self, recorder: MetricsRecorder, arrival: float) -> None:
        self._rec, self._arrival = recorder, arrival
        self._last: float | None = None
        self._done = False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0 or self._done:
            return
        now = time.monotonic()
        if self._last is None:
            self._rec.ttft.observe(now - self._arrival)
        else:
            self._rec.itl.observe(now - self._last)
        self._last = now
        self._rec.generation_tokens.inc(num_tokens)

    def finish(self, finish_reason: str, stats: RequestStats | None) -> None:
        if self._done:
            return
        self._done = True
        self._rec.e2e.observe(time.monotonic() - self._arrival)
        self._rec.request_success.labels(**self._rec._labels, finish_reason=finish_reason).inc()
        if stats is not None:
            self._rec.queue.observe(stats.queue_time)
