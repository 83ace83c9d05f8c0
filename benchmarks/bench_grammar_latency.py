"""Chat latency while a slow grammar compile runs beside it, against the same chats without one.

Starts `d3d serve` in each of MODES (the default target unless --serve-args say otherwise), then
alternates, round by round: CHATS small chats (`max_tokens` 4) one after another with nothing else running, and
CHATS more while one completion's 60 KB `regex` of 12,000 character classes is compiling (a
source within every size limit, which compiles for longer than --grammar-timeout). Each round's
regex differs, so none is compiled already. Prints p50 and p99 latency of both sets, and their
ratio.

    .venv/bin/python benchmarks/bench_grammar_latency.py --rounds 6 --chats 10 --modes ar async \\
        --json benchmarks/results/grammar_latency.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sglang_d3d.benchmarks.bench_serving import ServerProcess
from sglang_d3d.benchmarks.run_info import run_info

CLASSES = 12_000  # character classes in the slow regex (5 bytes each: 60,000 bytes)
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def slow_regex(round_no: int) -> str:
    """12,000 classes like `[c-x]`, different in every round."""
    return "".join(f"[{chr(97 + (i * 7 + round_no) % 20)}-z]" for i in range(CLASSES))


def chat(client: httpx.Client, model: str) -> float:
    start = time.perf_counter()
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - start


def chats(client: httpx.Client, model: str, n: int) -> list[float]:
    return [chat(client, model) for _ in range(n)]


def with_compile(client: httpx.Client, url: str, model: str, n: int, round_no: int,
                 settle: float) -> tuple[list[float], dict]:
    """`n` chats while one slow regex compiles; the compile request's status and seconds."""
    out: dict = {}

    def compile_request() -> None:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": "x", "max_tokens": 4, "regex": slow_regex(round_no)})
        out.update(status=r.status_code, seconds=round(time.perf_counter() - start, 2),
                   code=(r.json().get("error") or {}).get("code") if r.status_code != 200 else None)

    thread = threading.Thread(target=compile_request)
    thread.start()
    time.sleep(settle)  # the request is read, checked and handed to a compile worker
    times = chats(client, model, n)
    busy = thread.is_alive()  # still compiling when the last chat ended
    thread.join()
    return times, {**out, "in_flight_to_the_end": busy}


def dist(values: list[float]) -> dict:
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {"n": len(values), "p50_s": round(statistics.median(values), 4),
            "p99_s": round(qs[98], 4), "max_s": round(max(values), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["ar", "async"], help="one server each")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chats", type=int, default=10, help="chats per round and set")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between sending the slow regex and the first chat beside it")
    p.add_argument("--serve-args", default="",
                   help="more `d3d serve` flags, one string (default: the server's defaults)")
    p.add_argument("--weights", default="q4_1", help="recorded in the JSON: the target's weights")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    logs = Path(tempfile.gettempdir()) / "bench_grammar_latency"
    results = {}
    for mode in a.modes:
        server = ServerProcess(mode, shlex.split(a.serve_args), logs, timeout=1800)
        try:
            results[mode] = result = run(server.url, a)
        finally:
            server.stop()
        b, c = result["baseline"], result["compiling"]
        print(f"{mode}: baseline  p50 {b['p50_s']:.3f} s  p99 {b['p99_s']:.3f} s  (n={b['n']})")
        print(f"{mode}: compiling p50 {c['p50_s']:.3f} s  p99 {c['p99_s']:.3f} s  (n={c['n']})")
        print(f"{mode}: ratio p50 {result['p50_ratio']:.2f}x, p99 {result['p99_ratio']:.2f}x")
        print(f"{mode}: compile requests:", result["compiles"])
    if a.json:
        out = {**run_info(weights=a.weights), "args": vars(a), "modes": results}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def run(url: str, a) -> dict:
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        chats(client, model, 3)  # warm-up
        base: list[float] = []
        busy: list[float] = []
        compiles = []
        for i in range(a.rounds):  # alternating, so both sets meet the same hour
            base += chats(client, model, a.chats)
            times, info = with_compile(client, url, model, a.chats, i, a.settle)
            busy += times
            compiles.append(info)
    b, c = dist(base), dist(busy)
    return {"baseline": b, "compiling": c, "p50_ratio": round(c["p50_s"] / b["p50_s"], 3),
            "p99_ratio": round(c["p99_s"] / b["p99_s"], 3), "compiles": compiles}


if __name__ == "__main__":
    main()
