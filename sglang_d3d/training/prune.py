"""`d3d prune`: progressive layer pruning by acceptance length (the paper's recipe).

Each round: score every remaining layer by the held-out acceptance length of the drafter
without it; remove the `per_round` layers whose removal costs least; re-distil the pruned
drafter from the full drafter (its block distributions as teacher, KL at the mask slots);
measure again. Every depth records acceptance length (per draft position), the drafter's
branch-pass time and, optionally, sync and async end-to-end tokens/s (plain decoding measured
once beside them), because the depth to ship is the one with the highest end-to-end speed,
not the highest acceptance (prune_report.py).

Each round saves its drafter (`out_dir/depth_<n>`) and the table so far
(`out_dir/prune_rows.json`); rerunning the same command continues after the last finished
round (the re-distillation data order restarts; nothing else depends on it).

Pruning shortens the clean path too (the drafter's prefix cache runs only the kept layers), so
below full depth draft 1 is no longer the target's own prediction: the table shows what that
costs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_d3d.training.batches import BatchSpec, DataPosition, iterate_batches, split
from sglang_d3d.training.build import load_target
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.forward import block_hidden, clean_pass
from sglang_d3d.training.losses import kl_to_teacher
from sglang_d3d.training.measure import branch_batch_seconds, tokens_per_second
from sglang_d3d.training.objective import IGNORE
from sglang_d3d.training.prune_report import write_report
from sglang_d3d.training.shards import load_samples


@dataclass(frozen=True)
class PruneConfig:
    drafter_path: str = "sglang_d3d/assets/drafter"
    data_dir: str = "data/distill"
    out_dir: str = "runs/prune"
    results_dir: str = "benchmarks/results"
    target_path: str | None = None
    min_layers: int = 1
    per_round: int = 1  # layers removed per round (several where one at a time is too slow)
    max_rounds: int = 100
    eval_samples: int = 24  # held-out samples for acceptance length
    score_samples: int = 8  # held-out samples for scoring candidate layers (cheaper)
    heldout_every: int = 20  # must match training's split
    recover_steps: int = 20  # KL re-distillation steps after each round
    lr: float = 3e-4
    batch_size: int = 2
    num_anchors: int = 16
    branch_budget: int = 1
    e2e_prompts: int = 0  # >0: also measure async tokens/s on this many held-out prompts
    e2e_max_new_tokens: int = 64
    e2e_block: int = 0  # the engine's block size in the end-to-end runs (0: the drafter's)
    threads: int = 1
    seed: int = 0
    remeasure: bool = False  # only re-time the finished depths (on a quiet machine)

    def __post_init__(self) -> None:
        if self.per_round < 1 or self.min_layers < 1:
            raise ValueError("per_round >= 1 and min_layers >= 1 required")


ROWS = "prune_rows.json"


def least_useful(scores: dict[int, float], k: int) -> list[int]:
    """The k layer indices whose removal left the highest acceptance (ties: later layer)."""
    return sorted(scores, key=lambda i: (-scores[i], -i))[:k]


class Pruner:
    def __init__(self, cfg: PruneConfig) -> None:
        from sglang_d3d.models.drafter import D3DDrafter

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.target = load_target(cfg.target_path)
        self.full = D3DDrafter.from_pretrained(cfg.drafter_path, self.target)
        self.block = self.full.cfg.block_size
        self.train_set, held = split(load_samples(Path(cfg.data_dir)), cfg.heldout_every)
        self.held = held[: cfg.eval_samples]
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.pos = DataPosition()

    def accept(self, drafter, samples) -> float:
        return acceptance_length(drafter, samples, self.block).mean

    def measure(self, drafter, removed: list[int], scores: dict) -> dict:
        cfg = self.cfg
        r = acceptance_length(drafter, self.held, self.block)
        row = {"depth": drafter.num_layers, "source_layers": list(drafter.cfg.source_layers),
               "removed_source_layers": removed, "accept_len": r.mean,
               "accept_by_position": [round(x, 4) for x in r.by_position],
               "draft_s_per_branch_batch": branch_batch_seconds(drafter, self.block,
                                                                cfg.branch_budget),
               "candidate_accept_len": scores}
        if cfg.e2e_prompts > 0:
            row.update(self.end_to_end(drafter))
        return row

    def end_to_end(self, drafter) -> dict:
        """Sync and async tokens/s (and plain decoding's, timed right before them, since the
        machine's load drifts): the depth's speed is the better of its two modes."""
        cfg = self.cfg
        prompts = [s.prompt.tolist() for s in self.held[: cfg.e2e_prompts]]
        block = cfg.e2e_block or self.block
        run = {m: tokens_per_second(self.target, drafter, prompts, block, cfg.e2e_max_new_tokens, m)
               for m in ("ar", "sync", "async")}
        return {"ar_tokens_per_s": run["ar"]["tokens_per_s"],
                "sync_tokens_per_s": run["sync"]["tokens_per_s"],
                "async_tokens_per_s": run["async"]["tokens_per_s"],
                "engine_accept_len": run["sync"]["engine_accept_len"],
                "tokens_per_s": max(run["sync"]["tokens_per_s"], run["async"]["tokens_per_s"])}

    def score_layers(self, drafter) -> dict[int, float]:
        """Acceptance length without each layer, keyed by index into drafter.layers."""
        few = self.held[: self.cfg.score_samples]
        n = drafter.num_layers
        return {i: self.accept(drafter.prune([j for j in range(n) if j != i]), few)
                for i in range(n)}

    def _batches(self):
        spec = BatchSpec(self.block, self.cfg.num_anchors, self.full.cfg.min_block_size,
                         batch_size=self.cfg.batch_size)
        while True:
            for pos, batch in iterate_batches(self.train_set, spec, self.cfg.seed, self.pos,
                                              self.gen):
                self.pos = pos
                yield batch
            self.pos = DataPosition(self.pos.epoch + 1, 0, 0)

    def recover(self, student, batches) -> None:
        """Re-distil the pruned drafter's deltas towards the full drafter's mask slots."""
        params = student.trainable_parameters()
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        student.train()
        for _ in range(self.cfg.recover_steps):
            b = next(batches)
            sel = b["labels"] != IGNORE
            with torch.no_grad():
                t_past, _ = clean_pass(self.full, b)
                teacher = self.full.logits(block_hidden(self.full, b, t_past)[sel])
            past, _ = clean_pass(student, b)
            loss = kl_to_teacher(student.logits(block_hidden(student, b, past)[sel]), teacher)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        student.eval()

    def resume(self, out: Path) -> tuple[list[dict], object]:
        """-> (rows so far, drafter of the last finished round), or a fresh start."""
        from sglang_d3d.models.drafter import D3DDrafter

        saved = out / ROWS
        if not saved.exists():
            rows = [self.measure(self.full, [], {})]
            print(json.dumps(rows[0]), flush=True)
            self._save_rows(out, rows)
            return rows, self.full
        rows = json.loads(saved.read_text())
        last = rows[-1]
        if len(rows) == 1:
            return rows, self.full
        current = D3DDrafter.from_pretrained(out / f"depth_{last['depth']}", self.target)
        print(f"resuming after depth {last['depth']}", flush=True)
        return rows, current.eval()

    def _save_rows(self, out: Path, rows: list[dict]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / ROWS).write_text(json.dumps(rows, indent=1))

    def remeasure(self) -> list[dict]:
        """Re-time every finished depth (branch pass and end to end) without pruning, for a
        run whose timings shared the machine with other work; accepted lengths are kept."""
        from sglang_d3d.models.drafter import D3DDrafter

        out = Path(self.cfg.out_dir)
        if not (out / ROWS).exists():
            raise FileNotFoundError(f"--remeasure needs a pruning run in {out} ({ROWS} not "
                                    "found): run d3d prune without --remeasure first")
        rows = json.loads((out / ROWS).read_text())
        for r in rows:
            d = self.full if r["depth"] == self.full.num_layers else \
                D3DDrafter.from_pretrained(out / f"depth_{r['depth']}", self.target).eval()
            r["draft_s_per_branch_batch"] = branch_batch_seconds(d, self.block,
                                                                 self.cfg.branch_budget)
            if self.cfg.e2e_prompts > 0:
                r.update(self.end_to_end(d))
            print(json.dumps({k: r[k] for k in r if k != "candidate_accept_len"}), flush=True)
        self._save_rows(out, rows)
        write_report(rows, Path(self.cfg.results_dir), asdict(self.cfg), len(self.held))
        return rows

    def run(self) -> list[dict]:
        cfg, out = self.cfg, Path(self.cfg.out_dir)
        rows, current = self.resume(out)
        removed = list(rows[-1]["removed_source_layers"])
        batches = self._batches()
        for _ in range(cfg.max_rounds):
            k = min(cfg.per_round, current.num_layers - cfg.min_layers)
            if k <= 0:
                break
            t0 = time.perf_counter()
            scores = self.score_layers(current)
            drop = least_useful(scores, k)
            named = {str(current.cfg.source_layers[i]): v for i, v in scores.items()}
            removed = removed + [current.cfg.source_layers[i] for i in drop]
            current = current.prune([j for j in range(current.num_layers) if j not in drop])
            self.recover(current, batches)
            current.save_pretrained(out / f"depth_{current.num_layers}")
            row = self.measure(current, removed, named)
            row["prune_seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            self._save_rows(out, rows)
            print(json.dumps(row), flush=True)
            write_report(rows, Path(cfg.results_dir), asdict(cfg), len(self.held))
        write_report(rows, Path(cfg.results_dir), asdict(cfg), len(self.held))
        return rows


# One line per PruneConfig field: `d3d prune --help` and docs/cli.md print them.
PRUNE_HELP = {
    "drafter_path": "the trained drafter folder to prune",
    "data_dir": "the datagen shards it was trained on (held-out samples come from them)",
    "out_dir": "one drafter folder per depth, and the rows measured so far (resumable)",
    "results_dir": "where the pruning report (JSON and Markdown) is written",
    "target_path": "the target's HF folder (default: SmolLM2-135M-Instruct)",
    "min_layers": "stop at this many drafter layers",
    "per_round": "layers removed per round (several where one at a time is too slow)",
    "max_rounds": "stop after this many rounds",
    "eval_samples": "held-out samples for each depth's accepted length",
    "score_samples": "held-out samples for scoring candidate layers (cheaper)",
    "heldout_every": "every Nth sample is held out; must match training's split",
    "recover_steps": "KL re-distillation steps after each round",
    "lr": "learning rate of the recovery steps",
    "batch_size": "samples per recovery step",
    "num_anchors": "masked blocks per sample in the recovery steps",
    "branch_budget": "pre-drafted branches in the end-to-end runs",
    "e2e_prompts": "above 0: also measure async tokens/s on this many held-out prompts",
    "e2e_max_new_tokens": "new tokens per prompt in the end-to-end runs",
    "e2e_block": "the engine's block size in the end-to-end runs (0: the drafter's)",
    "threads": "CPU threads",
    "seed": "random seed",
    "remeasure": "only re-time the finished depths (run it on an otherwise idle machine)",
}


def add_prune_args(p: argparse.ArgumentParser) -> None:
    d = PruneConfig()
    for f in fields(PruneConfig):
        flag, default = "--" + f.name.replace("_", "-"), getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=PRUNE_HELP[f.name])
            continue
        p.add_argument(flag, type=type(default) if default is not None else str, default=default,
                       help=PRUNE_HELP[f.name])


def run_prune(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(PruneConfig)}
    pruner = Pruner(PruneConfig(**{k: v for k, v in vars(args).items() if k in names}))
    if pruner.cfg.remeasure:
        pruner.remeasure()
    else:
        pruner.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d prune", description=__doc__.splitlines()[0])
    add_prune_args(parser)
    return run_prune(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
