"""`d3d train`: distil the target's responses into a D3D block drafter.

Loop: packed batches (objective.py) -> weighted block CE + auxiliary AR loss (losses.py) ->
AdamW with warm-up and cosine decay, gradient accumulation -> held-out greedy acceptance length
every `eval_every` steps (evaluate.py) -> an engine-loadable checkpoint every `ckpt_minutes`
(checkpoint.py). Rerunning the same command resumes from `<out_dir>/trainer_state.pt`. Samples
are re-read from the data folder at every epoch, so datagen may keep adding shards meanwhile.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_d3d.training.batches import BatchSpec, head_ids_by_frequency, iterate_batches, split
from sglang_d3d.training.checkpoint import DRAFTER, load_state, save_checkpoint
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.losses import build_label_map, d3d_loss
from sglang_d3d.training.objective import position_weights
from sglang_d3d.training.setup import autocast, build_drafter, load_target, parse_layers
from sglang_d3d.training.shards import load_samples


@dataclass(frozen=True)
class TrainConfig:
    data_dir: str = "data/distill"
    out_dir: str = "runs/train"
    target_path: str | None = None  # None: the default SmolLM2-135M-Instruct
    init_from: str | None = None  # start from this drafter checkpoint instead of target layers
    layers: tuple[int, ...] = (0, 10, 20, 29)  # target layers copied into the drafter
    block_size: int = 16
    num_anchors: int = 16
    ar_positions: int = 32
    ar_weight: float = 0.1
    gamma: float = 7.0  # slot weight exp(-(j-1)/gamma)
    head_size: int = 16384  # 0: full-vocabulary head
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    warmup_steps: int = 30
    max_steps: int = 1000
    time_budget_min: float | None = None  # stop (and save) after this much wall time
    heldout_every: int = 20  # every n-th prompt index is held out
    eval_every: int = 100
    eval_samples: int = 40
    ckpt_minutes: float = 5.0
    max_seq_len: int = 512
    bf16: bool = True  # bf16 autocast for the forward (AMX); master weights stay fp32
    threads: int = 1
    seed: int = 0
    export_to: str | None = None  # copy the final drafter folder here

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("block_size >= 2, batch_size >= 1 and grad_accum >= 1 required")

    @property
    def batch_spec(self) -> BatchSpec:
        return BatchSpec(self.block_size, self.num_anchors, self.ar_positions, self.max_seq_len,
                         self.batch_size)


def lr_at(step: int, cfg: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio.

    Progress is steps / max_steps, or elapsed / time budget if that is further along: on a
    shared CPU the step rate is unknown in advance, and a run cut by its time budget should
    still end with a decayed learning rate.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.time_budget_min:
        frac = max(frac, elapsed_s / (60 * cfg.time_budget_min))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        torch.set_num_threads(cfg.threads)
        self.cfg, self.out = cfg, Path(cfg.out_dir)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.target = load_target(cfg.target_path)
        self.train_set, self.held = split(load_samples(Path(cfg.data_dir)), cfg.heldout_every)
        if not self.train_set:
            raise ValueError(f"no training samples under {cfg.data_dir}")
        state = load_state(self.out)
        self.drafter = build_drafter(self.target, cfg.init_from, list(cfg.layers), cfg.block_size)
        self._set_head(state)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step, self.history, self.elapsed_before = 0, [], 0.0
        self.t0 = time.monotonic()
        if state is not None:
            self._resume(state)
        self.weights = position_weights(cfg.block_size, cfg.gamma)

    def _set_head(self, state: dict | None) -> None:
        d = self.drafter
        if state is not None and state.get("head_ids") is not None:
            d.set_head(state["head_ids"])
        elif d.head_ids is None and self.cfg.head_size > 0:
            self._refresh_head()
        self.label_map = None if d.head_ids is None else build_label_map(d.head_ids, d.spec.vocab_size)

    def _refresh_head(self) -> None:
        """Re-pick the K most frequent tokens from all data read so far.

        Safe mid-training: the head rows are the target's frozen LM head, so a token's logit
        does not depend on which other tokens are in the head; only coverage changes.
        """
        d = self.drafter
        eos = self.target.hf_config.eos_token_id
        keep = tuple(eos if isinstance(eos, list) else [eos])
        d.set_head(head_ids_by_frequency(self.train_set, self.cfg.head_size, d.spec.vocab_size, keep))
        self.label_map = build_label_map(d.head_ids, d.spec.vocab_size)

    def _resume(self, state: dict) -> None:
        self.drafter.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state.get("history", [])
        self.elapsed_before = state.get("elapsed_s", 0.0)
        self.gen.set_state(state["rng"])

    def train_step(self, batches) -> dict:
        """One optimiser step over grad_accum micro-batches; returns logged numbers."""
        cfg, d = self.cfg, self.drafter
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg, self.elapsed())
        parts = []
        for batch in batches:
            with autocast(cfg.bf16):
                h = d.hidden(batch["input_ids"], batch["positions"], batch["mask"])
                lp = d3d_loss(h, batch, self.weights, d.head_logits, cfg.ar_weight, self.label_map)
            (lp.total / len(batches)).backward()
            parts.append(lp)
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        mean = lambda xs: float(sum(xs) / len(xs))  # noqa: E731
        acc = torch.stack([p.slot_acc for p in parts]).mean(0)
        return {"step": self.step, "loss": mean([float(p.total) for p in parts]),
                "block": mean([float(p.block) for p in parts]),
                "ar": mean([float(p.ar) for p in parts]),
                "acc1": float(acc[0]), "acc4": float(acc[3]) if acc.numel() > 3 else float("nan"),
                "lr": self.opt.param_groups[0]["lr"]}

    def evaluate(self) -> dict:
        held = self.held[: self.cfg.eval_samples]
        r = acceptance_length(self.drafter, held, self.cfg.block_size)
        return {"step": self.step, "accept_len": r.mean, "by_source": r.by_source,
                "num_blocks": r.num_blocks}

    def elapsed(self) -> float:
        """Training seconds over all runs of this output folder (resumes included)."""
        return self.elapsed_before + time.monotonic() - self.t0

    def save(self) -> None:
        save_checkpoint(self.out, self.drafter, self.opt, self.step, self.gen,
                        {"history": self.history, "config": asdict(self.cfg),
                         "elapsed_s": self.elapsed()})

    def _micro_batches(self):
        """Endless micro-batches; re-reads the data folder each epoch (datagen may be running)."""
        while True:
            yield from iterate_batches(self.train_set, self.cfg.batch_spec, self.gen)
            self.train_set, self.held = split(load_samples(Path(self.cfg.data_dir)),
                                              self.cfg.heldout_every)
            if self.cfg.head_size > 0 and self.cfg.init_from is None:
                self._refresh_head()

    def _log(self, row: dict, pbar) -> None:
        self.history.append(row)
        with open(self.out / "history.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if "accept_len" in row:
            pbar.write(f"step {row['step']}: held-out accept_len {row['accept_len']:.3f} "
                       f"{row['by_source']}")

    def run(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = last_ckpt = time.monotonic()
        stream = self._micro_batches()
        pbar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", mininterval=10)
        if self.step == 0:
            self._log(self.evaluate(), pbar)
        while self.step < cfg.max_steps:
            row = self.train_step([next(stream) for _ in range(cfg.grad_accum)])
            row["elapsed_s"] = round(self.elapsed(), 1)
            pbar.update(1)
            pbar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc1']:.2f}")
            if self.step % 10 == 0:
                self._log(row, pbar)
            if self.step % cfg.eval_every == 0:
                self._log(self.evaluate(), pbar)
            out_of_time = cfg.time_budget_min and self.elapsed() > 60 * cfg.time_budget_min
            if time.monotonic() - last_ckpt > 60 * cfg.ckpt_minutes or out_of_time:
                self.save()
                last_ckpt = time.monotonic()
            if out_of_time:
                break
        pbar.close()
        final = self.evaluate()
        self._log(final, pbar)
        self.save()
        if cfg.export_to:
            export(self.out / DRAFTER, Path(cfg.export_to))
        return final


def export(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / name, dst / name)


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if f.name == "layers":
            p.add_argument(flag, type=parse_layers, default=default, help="e.g. 0,1,2,29")
        elif f.name == "bf16":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            kind = float if f.name == "time_budget_min" else str
            p.add_argument(flag, type=kind, default=None)
        else:
            p.add_argument(flag, type=type(default), default=default)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_train(args: argparse.Namespace) -> int:
    final = Trainer(config_from_args(args)).run()
    print(json.dumps(final))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d train", description=__doc__.splitlines()[0])
    add_train_args(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
