"""Serving benchmark: a live `d3d serve` under concurrent streaming chat requests.

For each mode (a server started per mode, or one already running at --url), each dataset
(GSM8K questions, MT-Bench first turns) and each concurrency (1, 4, 16), it sends
--num-prompts streaming requests with that many in flight and reports the numbers below. The
modes' servers are all up at once and take each load in turn, so that drifting machine noise
hits them alike (--sequential: one server at a time, for GPUs that hold one model pair only):

- request throughput (req/s) and output throughput (generated tokens/s, from `usage`);
- TTFT: request sent -> first content chunk;
- TPOT: (latency - TTFT) / (output tokens - 1), per request;
- ITL: gaps between consecutive content chunks (a chunk holds one verify cycle's tokens, so
  with speculation ITL is per cycle, not per token; TPOT is the per-token figure);
- mean accepted length, branch hit rate and the share of cycle time spent decoding plainly
  ("plain": the adaptive controller's fallback), from the server's Prometheus counters over the run.

Each load runs in request variants (--variants): `plain`; `logprobs` (logprobs with
--top-logprobs alternatives per token); and `n` (--n choices per request, sharing one prefill).
Their cost is reported against the plain requests of the same mode, dataset and concurrency:
output tokens/s, TTFT and per-sequence TPOT, each as a ratio to plain.

Before each dataset and concurrency, --warmup-rounds rounds of `concurrency` requests (other
prompts from the same dataset) go through the server unmeasured: a long-running server has
compiled its paths and, with the adaptive controller, measured its plans at that batch size
already; the benchmark reports that steady state. `--warmup-rounds 0` measures a cold server.

With --rounds R, each load runs R times through every mode's server, the modes back to back
within a round (the first mode changing from round to round), and each mode is compared with
the first of --modes round by round: the geometric mean of the per-round ratios of tokens/s,
TPOT and TTFT, their range, and the standard error (benchmarks/paired.py). Loads of a few dozen
requests differ by several percent between two identical servers; the rounds say how much.
A server process also keeps a speed of its own for its lifetime (two processes decoding the
same load plainly were 3-10% apart, the same way round after round): --fresh-servers starts
new servers for each round, so that this averages out too.

Latencies are given as mean, p50 and p99 in milliseconds. Results are printed as a table and
saved as JSON (one row per mode x dataset x concurrency x variant, and the cost ratios).

    python benchmarks/bench_serving.py --modes ar async --num-prompts 64
    python benchmarks/bench_serving.py --url http://localhost:8000 --modes async
    python benchmarks/bench_serving.py --variants plain logprobs n --n 4 --top-logprobs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from sglang_d3d.benchmarks.paired import paired_ratios, print_paired
from sglang_d3d.benchmarks.serving_stats import plan_cells, scrape, spec_figures, why_cells

import sglang_d3d
from sglang_d3d.cli_args import count
from sglang_d3d.interleave import rotated
from sglang_d3d.prompts import BUNDLED, NAMED, dataset_path, question_text

DATASETS = tuple(NAMED)  # gsm8k (test split), mt_bench: the default sets
DEFAULT_OUT = Path("benchmarks/results/bench_serving.json")  # from the checkout root
VARIANTS = ("plain", "logprobs", "n")


# ---- prompts ----------------------------------------------------------------------------------


def prompt_texts(path: Path, seed: int = 0) -> list[str]:
    """Every prompt of a JSONL file (a `question`, `prompt` or `turns[0]` per line), once,
    shuffled with `seed`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    texts = [question_text(r) for r in rows]
    random.Random(seed).shuffle(texts)
    return texts


def load_prompts(path: Path, n: int, seed: int = 0) -> list[str]:
    """n prompts from a JSONL file (`prompt_texts`), cycled if short."""
    texts = prompt_texts(path, seed)
    return [texts[i % len(texts)] for i in range(n)]


# ---- one request ------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # every choice's
    sequences: int = 1  # choices generated (n)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token of one sequence (choices are generated side by side)."""
        per_sequence = self.output_tokens / self.sequences
        if per_sequence < 2:
            return None
        return (self.latency - self.ttft) / (per_sequence - 1)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res, start = RequestResult(ok=False, sequences=body.get("n", 1)), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"{r.status_code}: {(await r.aread())[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    res.ok, res.latency = True, time.perf_counter() - start
    return res


async def run_load(
    url: str, model: str, prompts: list[str], concurrency: int, variant: str, args
) -> tuple:
    """All prompts through `concurrency` workers; returns (results, wall seconds)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    headers = auth_headers(args.api_key)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits, headers=headers) as client:

        async def worker() -> None:
            while not queue.empty():
                body = request_body(model, queue.get_nowait(), args, variant)
                results.append(await stream_one(client, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def request_body(model: str, prompt: str, args, variant: str = "plain") -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if variant == "logprobs":
        body |= {"logprobs": True, "top_logprobs": args.top_logprobs}
    elif variant == "n":
        body["n"] = args.n
    return body | args.extra_body


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object, refused as a usage error otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- summary ----------------------------------------------------------------------------------


def dist_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall,
        "output_throughput": tokens / wall,
        "total_output_tokens": tokens,
        "ttft_ms": dist_ms([r.ttft for r in ok]),
        "tpot_ms": dist_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": dist_ms([x for r in ok for x in r.itl]),
    }


def variant_costs(rows: list[dict]) -> list[dict]:
    """Each non-plain row against the plain row of its mode, dataset, concurrency and round."""
    key = lambda r: (r["mode"], r["dataset"], r["concurrency"], r.get("round", 0))  # noqa: E731
    plain = {key(r): r for r in rows if r["variant"] == "plain"}
    costs = []
    for r in rows:
        base = plain.get(key(r))
        if r["variant"] == "plain" or base is None:
            continue
        costs.append({
            "mode": r["mode"], "dataset": r["dataset"], "concurrency": r["concurrency"],
            "variant": r["variant"], "round": r.get("round", 0),
            "output_throughput_ratio": _ratio(r["output_throughput"], base["output_throughput"]),
            "ttft_mean_ratio": _ratio(r["ttft_ms"]["mean"], base["ttft_ms"]["mean"]),
            "tpot_mean_ratio": _ratio(r["tpot_ms"]["mean"], base["tpot_ms"]["mean"]),
        })  # fmt: skip
    return costs


def _ratio(x: float | None, base: float | None) -> float | None:
    return None if x is None or not base else x / base


def print_costs(costs: list[dict]) -> None:
    print(f"{'mode':6} {'dataset':9} {'conc':>4} {'variant':8} "
          f"{'tok/s vs plain':>14} {'TTFT vs plain':>13} {'TPOT vs plain':>13}")  # fmt: skip
    for c in costs:
        print(
            f"{c['mode']:6} {c['dataset']:9} {c['concurrency']:>4} {c['variant']:8} "
            f"{_num(c['output_throughput_ratio'], 2):>14} {_num(c['ttft_mean_ratio'], 2):>13} "
            f"{_num(c['tpot_mean_ratio'], 2):>13}"
        )


def print_table(rows: list[dict], header: bool = True) -> None:
    if header:
        print(
            f"{'mode':6} {'dataset':9} {'conc':>4} {'variant':8} {'req/s':>7} {'tok/s':>8} "
            f"{'TTFT mean/p50/p99 ms':>22} {'TPOT mean/p50/p99 ms':>22} "
            f"{'ITL mean/p50/p99 ms':>22} {'acc_len':>7} {'hit':>5} {'plain':>5} {'fail':>4}  "
            "plans: cycles@ms(tokens a cycle)  why: plan@batch:reason=cycles"
        )
    for r in rows:
        print(
            f"{r['mode']:6} {r['dataset']:9} {r['concurrency']:>4} {r['variant']:8} "
            f"{r['request_throughput']:7.2f} {r['output_throughput']:8.1f} "
            f"{_trio(r['ttft_ms']):>22} {_trio(r['tpot_ms']):>22} {_trio(r['itl_ms']):>22} "
            f"{_num(r['mean_accepted_length'], 2):>7} {_num(r['branch_hit_rate'], 2):>5} "
            f"{_num(r.get('plain_time_share'), 2):>5} {r['num_failed']:>4}  "
            + plan_cells(r.get("plans", {}))
            + (f"  why: {why_cells(r['speculated'])}" if r.get("speculated") else ""),
            flush=True,
        )


def _trio(d: dict) -> str:
    return "/".join(_num(d[k], 1) for k in ("mean", "p50", "p99"))


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---- servers ----------------------------------------------------------------------------------


class ServerProcess:
    """`python -m sglang_d3d.server --mode MODE` on a free port, stopped with SIGINT (graceful drain)."""

    def __init__(self, mode: str, extra: list[str], log_dir: Path, timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_d3d.server", "--mode", mode, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *extra]
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(log_dir / f"server_{mode}.log", "w")  # noqa: SIM115 - closed in stop()
        # The child imports the same sglang_d3d as this process (a checkout or an install).
        root = Path(sglang_d3d.__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self._log.name}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(url: str, headers: dict | None = None) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30, headers=headers).json()["data"][0]["id"]


def served_mode(url: str, headers: dict | None = None) -> str:
    """The `mode` label the server puts on its metrics (ar | sync | async)."""
    text = httpx.get(f"{url}/metrics", timeout=30, headers=headers).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "mode" in s.labels:
                return s.labels["mode"]
    return "unknown"


# ---- driver -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    dataset: str
    concurrency: int
    variant: str
    prompts: list[str]


def bench_modes(urls: dict[str, str], args, rounds: range | None = None,
                first_turn: int = 0) -> list[dict]:
    """Every load (dataset, concurrency, variant) through each mode's server in turn: machine
    noise drifts over minutes, and running one mode's loads after the other's put it all in
    the ratio (measured: 0.97x-1.14x between two servers that both decoded plainly).
    rounds: which of the --rounds to run here (default all); first_turn: where the modes'
    rotation starts."""
    headers = auth_headers(args.api_key)
    models = {mode: served_model(url, headers) for mode, url in urls.items()}
    for mode, url in urls.items():
        warm = request_body(models[mode], "Hello!", args) | {"max_tokens": 8}
        asyncio.run(run_load_once(url, warm, headers))
    rows = []
    for dataset in args.datasets:
        pool = dataset_prompts(dataset, args)
        for c, conc in enumerate(args.concurrency):
            for mode, url in urls.items():
                warm_up(url, models[mode], dataset, conc, args, len(pool))
            for v, variant in enumerate(args.variants):
                k = c * len(args.variants) + v if args.fresh_prompts else 0
                n = args.num_prompts
                load = Load(dataset, conc, variant, pool[k * n : (k + 1) * n])
                for k in rounds or range(args.rounds):
                    turn = first_turn + len(rows) // len(urls)
                    for mode in rotated(list(urls), turn):  # no mode always first
                        row = measure(urls[mode], mode, models[mode], load, args, headers)
                        rows.append(row | {"round": k})
                        print_table(rows[-1:], header=len(rows) == 1)
    return rows


def measure(url: str, mode: str, model: str, load: Load, args, headers: dict) -> dict:
    before = scrape(url, headers)
    results, wall = asyncio.run(run_load(url, model, load.prompts, load.concurrency,
                                         load.variant, args))
    row = {"mode": mode, "dataset": load.dataset, "concurrency": load.concurrency,
           "variant": load.variant, "model": model}  # fmt: skip
    return row | summarize(results, wall) | spec_figures(before, scrape(url, headers))


def dataset_prompts(dataset: str, args) -> list[str]:
    """The measured prompts of one dataset: --num-prompts, shared by
    every load, or with --fresh-prompts as many again for each (concurrency, variant), so
    that no load's prompts went through the server before it (whose index of earlier
    requests' text would hold their answers). The dataset must then hold them all, and the
    warm-ups' after them: a dataset that short is refused, not cycled."""
    loads = len(args.concurrency) * len(args.variants) if args.fresh_prompts else 1
    measured = args.num_prompts * loads
    if args.fresh_prompts:
        have = len(prompt_texts(dataset_path(dataset), args.seed))
        need = measured + max(args.concurrency) * args.warmup_rounds
        if have < need:
            raise SystemExit(f"--fresh-prompts: {dataset} has {have} prompts; {len(args.concurrency)}"
                             f" concurrencies x {len(args.variants)} variants x {args.num_prompts} "
                             f"and the warm-ups need {need}")
    return load_prompts(dataset_path(dataset), measured, args.seed)


def warm_up(url: str, model: str, dataset: str, concurrency: int, args,
            measured: int | None = None) -> None:
    """Unmeasured requests at this concurrency, from prompts the measured loads do not use
    (those after the first `measured`, default --num-prompts)."""
    n = concurrency * args.warmup_rounds
    if n == 0:
        return
    skip = args.num_prompts if measured is None else measured
    pool = load_prompts(dataset_path(dataset), skip + n, args.seed)
    asyncio.run(run_load(url, model, pool[skip:], concurrency, "plain", args))


async def run_load_once(url: str, body: dict, headers: dict) -> None:
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        await stream_one(client, url, body)


def _dataset(name: str) -> str:
    """A set prompts.dataset_path knows, or an existing JSONL file (named sets are looked up in
    the datasets folder only when loaded)."""
    if name.endswith(".jsonl") and not Path(name).is_file():
        known = ", ".join(BUNDLED)
        raise argparse.ArgumentTypeError(f"{name!r}: use {known} or an existing .jsonl file")
    if name not in NAMED:
        try:
            dataset_path(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be 1 or more")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="d3d bench-serving", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="benchmark this running server (its mode) instead of --modes")
    p.add_argument("--modes", nargs="+", default=["ar", "async"], choices=["ar", "sync", "async", "fused"],
                   help="start a server per mode and load each in turn (ignored with --url)")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), type=_dataset,
                   help=f"{', '.join(BUNDLED)} (bundled), or a JSONL file of prompts")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16],
                   help="requests in flight; one load per value")
    p.add_argument("--num-prompts", type=int, default=32, help="per dataset and concurrency")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--warmup-rounds", type=count, default=1,
                   help="unmeasured rounds of `concurrency` requests before each load (0: cold)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="times each load runs through every mode, for paired ratios to the first mode")
    p.add_argument("--fresh-servers", action="store_true",
                   help="start new servers for every round: a server process keeps its own speed "
                   "(measured: plain decoding 3-10%% apart between two processes), so rounds "
                   "on the same processes cannot average it out")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="each (concurrency, variant) load its own --num-prompts prompts, none "
                   "sent before it, so started servers keep copies from earlier requests' text "
                   "(--shared-lookup-tokens) on; with --rounds > 1 it needs --fresh-servers")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of every request (0: greedy)")
    p.add_argument("--extra-body", type=_json_object, default={},
                   help='JSON object merged into every request, e.g. \'{"frequency_penalty": 0.5, '
                   '"ignore_eos": true}\' (penalties, vLLM\'s fields)')
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="request kinds per load; logprobs and n are compared against plain")
    p.add_argument("--n", type=int, default=2, help="choices per request in the n variant")
    p.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token (0-20)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request counts as failed")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to become healthy")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON results file")
    p.add_argument("--api-key", default=os.environ.get("D3D_API_KEY", "").split(",")[0] or None,
                   help="for a server that requires one (default: the first of $D3D_API_KEY)")
    p.add_argument("--sequential", action="store_true",
                   help="one mode's server at a time (where two models do not fit in memory "
                   "at once); by default every mode's server is up and loads alternate")
    p.add_argument(
        "--server-args",
        default="",
        help='extra `d3d serve` flags for started servers, e.g. "--target /m --device cuda"; '
        "they get --shared-lookup-tokens 0 unless these set it (the loads repeat their prompts; "
        "a server given by --url should run with it off too)",
    )
    return p


def _with_servers(modes: list[str], args) -> list[dict]:
    """With --fresh-servers, each round with servers of its own; else `_serve` once."""
    if not args.fresh_servers:
        return _serve(modes, args)
    return [row for k in range(args.rounds) for row in _serve(modes, args, range(k, k + 1), k)]


def started_server_args(server_args: str, fresh_prompts: bool = False) -> list[str]:
    """`d3d serve` flags for the servers the benchmark starts. Every load sends the same
    prompts (each concurrency, variant and round) unless --fresh-prompts, so copies from
    earlier requests' text (`--shared-lookup-tokens`) would verify the answers the server gave
    the same prompts a minute before: a cache's hit rate, not serving. Off then, unless
    --server-args sets it."""
    flags = server_args.split()
    if not fresh_prompts and not any(f.split("=")[0] == "--shared-lookup-tokens" for f in flags):
        flags += ["--shared-lookup-tokens", "0"]
    return flags


def _serve(modes: list[str], args, rounds: range | None = None, first_turn: int = 0) -> list[dict]:
    """Start a server per mode (all at once: an idle one costs memory, not time), bench them
    load by load, stop them."""
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in modes:
            servers[mode] = ServerProcess(mode, started_server_args(args.server_args,
                                                                    args.fresh_prompts),
                                          args.out.parent, args.server_timeout)
        return bench_modes({m: s.url for m, s in servers.items()}, args, rounds, first_turn)
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fresh_servers and (args.url or args.sequential):
        parser.error("--fresh-servers starts every mode's server per round: not with --url or --sequential")
    if args.fresh_prompts and args.rounds > 1 and not args.fresh_servers:
        parser.error("--fresh-prompts with --rounds > 1 needs --fresh-servers: a second round on "
                     "the same servers repeats the first's prompts")
    if args.url:  # one running server, one mode: it says which
        url = args.url.rstrip("/")
        rows = bench_modes({served_mode(url, auth_headers(args.api_key)): url}, args)
    elif args.sequential:
        rows = [r for mode in args.modes for r in _with_servers([mode], args)]
    else:
        rows = _with_servers(args.modes, args)
    print()
    print_table(rows)
    costs = variant_costs(rows)
    if costs:
        print()
        print_costs(costs)
    paired = paired_ratios(rows, args.modes[0]) if not args.url else []
    if paired:
        print(f"\neach mode against {args.modes[0]}, round by round:")
        print_paired(paired)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "results": rows,
               "costs": costs, "paired": paired}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
