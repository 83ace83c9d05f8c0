"""The least time a 4-bit pass of the default target can take on this CPU, from what the CPU
can do at most, and what a second thread adds.

Measured (benchmarks/floors.cpp): AVX-512 VNNI byte dot products and fp32 multiply-adds per
second on 1 thread and on 2 at once, and memory read bandwidth on 1 and on 2 threads. Counted:
the default target's multiply-adds and weight bytes per row (its config). From those, a lower
bound per pass, taking every weight from memory once and overlapping all arithmetic with it:

    floor(rows) = max(weight bytes / bandwidth,
                      rows x layer products / byte products per second x (2 for 14-bit inputs, 1 for 8-bit)
                      + head rows x head products / fp32 multiply-adds per second)

A projection's 14-bit inputs take two byte products per weight (models/csrc/block_mm.cpp), the
drafter's 8-bit ones one; the LM head runs in fp32. Attention, norms and rounding are left out,
so the real pass costs more. With `--passes` (a bench_passes.py JSON from the same machine),
each floor is also shown over that run's measured plain step, beside the measured pass.

    python benchmarks/bench_floors.py --passes benchmarks/results/passes_xeon106.json \\
        --json benchmarks/results/floors_xeon106.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_d3d.models import cpu_kernels, loading

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

Q4_BYTES = 20 / 32  # Q4_1: 16 bytes of nibbles, fp16 d and m per block of 32 weights
Q8_BYTES = 34 / 32  # Q8_0: 32 int8 and an fp16 d per block


@dataclass(frozen=True)
class Machine:
    """Rates on one thread: byte products and fp32 multiply-adds per ns, read GB/s."""

    byte_products_per_ns: float
    fmas_per_ns: float
    read_gb_per_s: float


@dataclass(frozen=True)
class Shapes:
    """Per token: the layers' multiply-adds and the LM head's; weight bytes of a pass."""

    layer_macs: int
    head_macs: int

    @property
    def weight_bytes(self) -> float:
        return self.layer_macs * Q4_BYTES + self.head_macs * Q8_BYTES


def shapes_of(config: dict) -> Shapes:
    h, inter, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 2 * h * inter + inter * h  # qkv, o, gate and up, down
    return Shapes(n * per_layer, h * config["vocab_size"])


def floor_ms(m: Machine, s: Shapes, rows: int, head_rows: int, input_bits: int) -> float:
    """The least ms of a pass of `rows` inputs of which `head_rows` take the LM head."""
    products = s.layer_macs * (2 if input_bits == 14 else 1)
    compute_ns = rows * products / m.byte_products_per_ns + head_rows * s.head_macs / m.fmas_per_ns
    memory_ns = s.weight_bytes / m.read_gb_per_s  # bytes / (GB/s) = ns
    return max(compute_ns, memory_ns) / 1e6


# (name in bench_passes.py's JSON, rows, head rows, input bits)
PASSES = (
    ("target q4 AR step, B=1", 1, 1, 14),
    ("target q4 verify, B=4", 4, 4, 14),
    ("target q4 verify, B=8", 8, 8, 14),
    ("drafter sync draft, 1 new token + block 4, q4 base", 5, 4, 8),
)


def main() -> None:
    a = _args()
    ext = rates_extension()
    rates = _measure(ext, a.iterations, a.read_mb)
    one = Machine(64 / rates["dpbusd_ns"][1], 16 / rates["fma_ns"][1], rates["read_gb_per_s"][1])
    config = json.loads((loading.resolve_target_path(None) / "config.json").read_text())
    shapes = shapes_of(config)
    measured = _measured(a.passes) if a.passes else {}
    plain = measured.get(PASSES[0][0])
    rows = []
    for name, n, head, bits in PASSES:
        f = floor_ms(one, shapes, n, head, bits)
        rows.append({"pass": name, "rows": n, "head_rows": head, "input_bits": bits, "floor_ms": round(f, 2),
                     "measured_ms": measured.get(name),
                     "floor_over_plain_step": round(f / plain, 2) if plain else None,
                     "measured_over_plain_step": round(measured[name] / plain, 2) if plain and name in measured else None})
    _print(rates, one, shapes, rows)
    if a.json:
        out = {**run_info(weights="q4_1 (default target), Q8_0 head"), "args": vars(a), "rates": rates,
               "layer_macs": shapes.layer_macs, "head_macs": shapes.head_macs, "passes": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def rates_extension():
    """floors.cpp built and loaded (its rate loops)."""
    return cpu_kernels.build("d3d_floors", ("floors.cpp",), ["-march=native"], folder=Path(__file__).resolve().parent,
                             module=True)


def _measure(ext, iterations: int, read_mb: int) -> dict:
    """Each rate on 1 thread and per thread on 2 at once, best of 3."""
    out = {"dpbusd_ns": {}, "fma_ns": {}, "read_gb_per_s": {}}
    for threads in (1, 2):
        for what in ("dpbusd", "fma"):
            out[f"{what}_ns"][threads] = round(min(ext.ns_per_instruction(what, iterations, threads) for _ in range(3)), 4)
        total = max(ext.read_gb_per_s(read_mb << 20, threads, 3) for _ in range(3))
        out["read_gb_per_s"][threads] = round(total, 2)
    if out["dpbusd_ns"][1] < 0:
        sys.exit("this CPU (or build) lacks AVX-512 VNNI: the floors are the AVX-512 path's")
    return out


def _measured(path: str) -> dict[str, float]:
    """bench_passes.py's medians at 1 thread, by pass name."""
    med = json.loads(Path(path).read_text())["median"]
    return {name: by["1"] for name, by in med.items() if "1" in by}


def _print(rates: dict, m: Machine, s: Shapes, rows: list[dict]) -> None:
    for what, unit in (("dpbusd_ns", "ns a 512-bit byte dot product"), ("fma_ns", "ns a 512-bit fp32 multiply-add")):
        r = rates[what]
        print(f"{unit}: {r[1]:.3f} on 1 thread, {r[2]:.3f} each on 2 at once ({r[1] / r[2]:.2f}x the work per thread)")
    bw = rates["read_gb_per_s"]
    print(f"memory read: {bw[1]:.1f} GB/s on 1 thread, {bw[2]:.1f} on 2 ({bw[2] / bw[1]:.2f}x)")
    print(f"per token: {s.layer_macs / 1e6:.1f}M layer multiply-adds, {s.head_macs / 1e6:.1f}M in the head, "
          f"{s.weight_bytes / 1e6:.1f} MB of weights; on 1 thread, a row's layers take at least "
          f"{2 * s.layer_macs / m.byte_products_per_ns / 1e6:.2f} ms (14-bit inputs) or "
          f"{s.layer_macs / m.byte_products_per_ns / 1e6:.2f} ms (8-bit), its head {s.head_macs / m.fmas_per_ns / 1e6:.2f} ms")
    print("| pass (1 thread) | rows | floor ms | measured ms | floor / plain step | measured / plain step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pass']} | {r['rows']} | {r['floor_ms']} | {r['measured_ms'] or '-'} | "
              f"{r['floor_over_plain_step'] or '-'} | {r['measured_over_plain_step'] or '-'} |")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", default=None, help="a bench_passes.py JSON from this machine (its 1-thread medians)")
    p.add_argument("--iterations", type=int, default=240_000_000, help="instructions a rate is timed over")
    p.add_argument("--read-mb", type=int, default=512, help="buffer read for the bandwidth")
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
