"""`d3d bench` with one engine's adaptive controller set differently, to compare a controller
setting side by side with the default in one run.

List the same adaptive mode twice under two names (`async-adaptive@8` and
`async-adaptive-cut0@8` build the same engine: the cutoff is 0 by default); the engine built
`--engine N`th (in `--modes` order, `ar` included) gets each `--set name=value` on its
controller (engine/adaptive.py `BlockController` fields). The trees' yield factor against chain
rates alone:

    .venv/bin/python -m benchmarks.diag_controller --engine 4 --set tree_prior=1e12 \\
        --dataset gsm8k --num-prompts 12 --max-new-tokens 128 --branch-budget 1 \\
        --block-size 8 --modes ar,sync@4,async-adaptive@8,async-adaptive-cut0@8
"""

from __future__ import annotations

import argparse
import sys

import sglang_d3d.bench as bench
from sglang_d3d.cli import main


def setting(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if not name or not value:
        raise argparse.ArgumentTypeError(f"expected name=value, not {text!r}")
    return name, float(value)


def patch(engine_index: int, settings: dict[str, float]) -> None:
    """The `engine_index`-th engine `d3d bench` builds gets `settings` on its controller."""
    real, built = bench.SpecEngine, []

    def make(cfg, *args, **kwargs):
        engine = real(cfg, *args, **kwargs)
        built.append(engine)
        if len(built) == engine_index:
            for name, value in settings.items():
                if not hasattr(engine.controller, name):
                    raise SystemExit(f"the controller has no setting {name!r}")
                setattr(engine.controller, name, value)
            print(f"engine {engine_index}: controller {settings}", flush=True)
        return engine

    bench.SpecEngine = make


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=int, required=True, help="which engine built (1 = first)")
    parser.add_argument("--set", type=setting, action="append", required=True, dest="settings")
    ours, rest = parser.parse_known_args(argv)
    patch(ours.engine, dict(ours.settings))
    return main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
