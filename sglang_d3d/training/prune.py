"""`d3d prune`: progressive layer pruning by acceptance length.

At each depth: drop each remaining layer in turn and measure held-out acceptance length; remove
the layer whose loss hurts least; re-distil the pruned drafter briefly from the full drafter
(its block distributions as teacher, position-weighted KL), since the remaining layers adapt
after recovery; measure again. Every depth records acceptance length, drafter seconds per
branch batch and (optionally) async end-to-end tokens/s, because the depth to ship is the one
with the lowest end-to-end latency, not the highest acceptance.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_d3d.training.batches import BatchSpec, iterate_batches, split
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.losses import distill_loss, map_labels
from sglang_d3d.training.measure import async_tokens_per_second, branch_batch_seconds
from sglang_d3d.training.objective import IGNORE, position_weights
from sglang_d3d.training.prune_report import write_report
from sglang_d3d.training.setup import autocast, load_target
from sglang_d3d.training.shards import load_samples


@dataclass(frozen=True)
class PruneConfig:
    drafter_path: str = "sglang_d3d/assets/drafter"
    data_dir: str = "data/distill"
    out_dir: str = "runs/prune"
    results_dir: str = "benchmarks/results"
    target_path: str | None = None
    min_layers: int = 1
    eval_samples: int = 24  # held-out samples for acceptance length
    heldout_every: int = 20  # must match training's split
    recover_steps: int = 20  # KL re-distillation steps after each removal
    lr: float = 2e-4
    batch_size: int = 4
    gamma: float = 7.0
    branch_budget: int = 4
    e2e_prompts: int = 0  # >0: also measure async tokens/s on this many held-out prompts
    e2e_max_new_tokens: int = 64
    threads: int = 1
    bf16: bool = True
    seed: int = 0


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
        self.weights = position_weights(self.block, cfg.gamma)
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def accept(self, drafter) -> float:
        return acceptance_length(drafter, self.held, self.block).mean

    def measure(self, drafter, removed: list[int], ablation: dict) -> dict:
        cfg = self.cfg
        row = {"depth": drafter.num_layers, "source_layers": list(drafter.cfg.source_layers),
               "removed_source_layers": removed, "accept_len": self.accept(drafter),
               "draft_s_per_branch_batch": branch_batch_seconds(drafter, self.block,
                                                                cfg.branch_budget),
               "ablation_accept_len": ablation}
        if cfg.e2e_prompts > 0:
            prompts = [s.prompt.tolist() for s in self.held[: cfg.e2e_prompts]]
            row.update(async_tokens_per_second(self.target, drafter, prompts, self.block,
                                               cfg.e2e_max_new_tokens))
        return row

    def least_useful(self, drafter) -> tuple[int, dict]:
        """Index (into drafter.layers) whose removal costs the least acceptance length."""
        scores = {}
        for i in range(drafter.num_layers):
            keep = [j for j in range(drafter.num_layers) if j != i]
            scores[i] = self.accept(drafter.prune(keep))
        best = max(scores, key=scores.get)
        named = {str(drafter.cfg.source_layers[i]): v for i, v in scores.items()}
        return best, named

    def recover(self, student) -> None:
        """Brief KL distillation of `student` towards the full drafter's block distributions."""
        cfg = self.cfg
        for p in student.parameters():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
        spec = BatchSpec(self.block, 16, 0, 512, cfg.batch_size)
        batches = iterate_batches(self.train_set, spec, self.gen)
        label_map = None if student.head_ids is None else _label_map(student)
        for _ in range(cfg.recover_steps):
            b = next(batches)
            sel = map_labels(b["labels"], label_map) != IGNORE
            with torch.no_grad(), autocast(cfg.bf16):
                t_h = self.full.hidden(b["input_ids"], b["positions"], b["mask"])
                teacher = self.full.head_logits(t_h[sel])
            with autocast(cfg.bf16):
                h = student.hidden(b["input_ids"], b["positions"], b["mask"])
                loss = distill_loss(h, teacher, sel, b["block_pos"], self.weights,
                                    student.head_logits)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        student.eval()

    def run(self) -> list[dict]:
        cfg, out = self.cfg, Path(self.cfg.out_dir)
        current, removed, rows = self.full, [], []
        rows.append(self.measure(current, [], {}))
        while current.num_layers > cfg.min_layers:
            t0 = time.perf_counter()
            idx, ablation = self.least_useful(current)
            removed = removed + [current.cfg.source_layers[idx]]
            current = current.prune([j for j in range(current.num_layers) if j != idx])
            self.recover(current)
            current.save_pretrained(out / f"depth_{current.num_layers}")
            row = self.measure(current, removed, ablation)
            row["prune_seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        write_report(rows, Path(cfg.results_dir), asdict(cfg), len(self.held))
        return rows


def _label_map(drafter) -> torch.Tensor:
    from sglang_d3d.training.losses import build_label_map

    return build_label_map(drafter.head_ids, drafter.spec.vocab_size)


def add_prune_args(p: argparse.ArgumentParser) -> None:
    d = PruneConfig()
    for f in fields(PruneConfig):
        flag, default = "--" + f.name.replace("_", "-"), getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument(flag, type=type(default) if default is not None else str, default=default)


def run_prune(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(PruneConfig)}
    Pruner(PruneConfig(**{k: v for k, v in vars(args).items() if k in names})).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d prune", description=__doc__.splitlines()[0])
    add_prune_args(parser)
    return run_prune(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
