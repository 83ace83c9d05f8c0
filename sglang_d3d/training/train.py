"""`d3d train`: distil the target's responses into a D3D block drafter.

Recipe (docs/drafter.md): start from the whole pretrained target (every layer, embedding and
head, shared and frozen) plus a learned mask embedding and zero low-rank deltas on mask slots;
train the deltas on the target's own responses with packed mask blocks (objective.py),
KL to the target's distribution (or CE on its greedy tokens), early drafts sampled more often.

Loop: batches (batches.py) -> clean pass without gradient, block pass with (forward.py) ->
loss (losses.py) -> AdamW, warm-up + cosine over `max_steps` -> held-out acceptance every
`eval_every` steps (evaluate.py) -> checkpoint every `ckpt_minutes`. Rerunning the same command
resumes exactly: weights, optimiser, schedule, RNG and data position are in the checkpoint.
`session_minutes` stops (and saves) one invocation, so a long run spans several sittings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_d3d.training.batches import BatchSpec, DataPosition, iterate_batches, split
from sglang_d3d.training.build import build_drafter, load_target, parse_layers
from sglang_d3d.training.checkpoint import DRAFTER, export, load_state, save_checkpoint
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.forward import block_hidden, clean_pass, pick_rows, teacher_source
from sglang_d3d.training.losses import accuracy_by_draft, label_probs, slot_loss
from sglang_d3d.training.objective import IGNORE, SLOT_WEIGHTS, chain_weights, draft_weights
from sglang_d3d.training.shards import load_samples

CHOICES = {"loss": ("kl", "ce"), "dtype": ("auto", "float32", "bfloat16"),
           "slot_weights": SLOT_WEIGHTS}


@dataclass(frozen=True)
class TrainConfig:
    data_dir: str = "data/distill"
    out_dir: str = "runs/train"
    target_path: str | None = None  # None: the default SmolLM2-135M-Instruct
    init_from: str | None = None  # start from this drafter checkpoint
    layers: tuple[int, ...] | None = None  # target layers the drafter runs (None: all)
    block_size: int = 16
    min_block_size: int = 0  # >0: blocks of mixed sizes in [min_block_size, block_size]
    num_anchors: int = 24
    rank: int = 32  # low-rank delta rank
    alpha: float = 32.0
    loss: str = "kl"  # kl: KL to the target's distribution; ce: its greedy tokens
    gamma: float = 7.0  # draft d is trained with probability exp(-(d-1)/gamma)
    # which slots enter the loss: "position" keeps draft d with probability exp(-(d-1)/gamma);
    # "confidence" with the target's confidence in its block's earlier drafts (chain_weights)
    slot_weights: str = "position"
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 1000
    session_minutes: float | None = None  # stop (and save) this invocation after this long
    stop_at_step: int | None = None  # stop (and save) at this step; the schedule still ends
    # at max_steps (equal-step comparisons of losses or formats over one schedule)
    heldout_every: int = 20  # every n-th prompt index is held out
    eval_every: int = 100
    eval_samples: int = 40
    ckpt_minutes: float = 5.0
    max_seq_len: int = 512
    dtype: str = "auto"  # auto: fp32 on CPUs without bf16 matrix units, bf16 on GPUs
    device: str = "cpu"
    threads: int = 1
    seed: int = 0
    export_to: str | None = None  # copy the final drafter folder here
    initial_eval: bool = True  # evaluate the untrained drafter first (off: arms sharing a start)

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("block_size >= 2, batch_size >= 1 and grad_accum >= 1 required")
        if self.loss not in CHOICES["loss"]:
            raise ValueError(f"--loss must be kl or ce, not {self.loss!r}")
        if self.slot_weights not in SLOT_WEIGHTS:
            raise ValueError(f"--slot-weights must be one of {', '.join(SLOT_WEIGHTS)}, "
                             f"not {self.slot_weights!r}")

    @property
    def batch_spec(self) -> BatchSpec:
        return BatchSpec(self.block_size, self.num_anchors, self.min_block_size, self.max_seq_len,
                         self.batch_size)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps.
    A pure function of the step, so a resumed run continues the same schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        from sglang_d3d.models.loading import resolve_dtype

        torch.set_num_threads(cfg.threads)
        self.cfg, self.out = cfg, Path(cfg.out_dir)
        self.dtype = resolve_dtype(cfg.dtype, cfg.device)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.target = load_target(cfg.target_path, self.dtype, cfg.device)
        self.train_set, self.held = split(load_samples(Path(cfg.data_dir)), cfg.heldout_every)
        if not self.train_set:
            raise ValueError(f"no training samples under {cfg.data_dir}")
        self.drafter = build_drafter(self.target, cfg.init_from, cfg.layers, cfg.block_size,
                                     cfg.rank, cfg.alpha, cfg.seed, cfg.min_block_size)
        self.opt = torch.optim.AdamW(self.drafter.trainable_parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step, self.history, self.elapsed_before = 0, [], 0.0
        self.pos = DataPosition()
        self.t0 = time.monotonic()
        self.weights = draft_weights(cfg.block_size, cfg.gamma)
        state = load_state(self.out)
        if state is not None:
            self._resume(state)

    def _resume(self, state: dict) -> None:
        self.drafter.load_own_state(state["model"])
        if "optimizer" in state:
            self.opt.load_state_dict(state["optimizer"])
        else:  # committed resume point: same schedule and data, Adam's moments start afresh
            print(f"resuming at step {state['step']} without optimizer moments", flush=True)
        self.step, self.history = state["step"], state.get("history", [])
        self.elapsed_before = state.get("elapsed_s", 0.0)
        self.pos = DataPosition(**state["data_position"])
        self.gen.set_state(state["rng"])

    # ---- one step --------------------------------------------------------------------------
    def keep(self, labelled: torch.Tensor, keep_p: torch.Tensor) -> torch.Tensor:
        """[N, KM] bool: labelled slots, each kept in the loss with probability keep_p."""
        draw = torch.rand(keep_p.shape, generator=self.gen).to(keep_p.device)
        return labelled & (draw < keep_p)

    @torch.no_grad()
    def teacher_logits(self, batch: dict, clean_h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[M, V] the target's logits at the slots picked by rows [N, KM] bool."""
        t_h = teacher_source(self.drafter, self.target, batch, clean_h)
        return self.drafter.logits(pick_rows(t_h, batch["slot_pos"], rows))

    def loss_rows(self, batch: dict, clean_h: torch.Tensor):
        """-> (sel [N, KM] bool: the slots in this step's loss, teacher [M, V] at them or None)."""
        labelled = batch["labels"] != IGNORE
        if self.cfg.slot_weights == "position":
            sel = self.keep(labelled, self.weights.to(labelled.device)[batch["slot_draft"]])
            kl = self.cfg.loss == "kl"
            return sel, self.teacher_logits(batch, clean_h, sel) if kl else None
        # confidence: the teacher at every labelled slot first, to weigh the chains
        scored = self.teacher_logits(batch, clean_h, labelled)  # [L, V]
        conf = torch.ones(labelled.shape, device=scored.device)
        conf[labelled] = label_probs(scored, batch["labels"][labelled])
        sel = self.keep(labelled, chain_weights(conf, batch["slot_draft"]))
        return sel, scored[sel[labelled]]

    def micro_step(self, batch: dict) -> dict:
        d, dev = self.drafter, self.cfg.device
        batch = {k: v.to(dev) for k, v in batch.items()}
        past, clean_h = clean_pass(d, batch)
        sel, teacher = self.loss_rows(batch, clean_h)
        student = d.logits(block_hidden(d, batch, past)[sel])  # [M, V]
        loss = slot_loss(student, teacher, batch["labels"][sel], self.cfg.loss)
        acc = accuracy_by_draft(student.cpu(), batch["labels"][sel].cpu(),
                                batch["slot_draft"][sel].cpu(), self.cfg.block_size)
        return {"loss": loss, "acc": acc}

    def train_step(self, batches: list[dict]) -> dict:
        """One optimiser step over grad_accum micro-batches; returns logged numbers."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        parts = []
        for batch in batches:
            out = self.micro_step(batch)
            (out["loss"] / len(batches)).backward()
            parts.append(out)
        torch.nn.utils.clip_grad_norm_(self.drafter.trainable_parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        acc = torch.stack([p["acc"] for p in parts]).nanmean(0)
        return {"step": self.step, "loss": sum(float(p["loss"].detach()) for p in parts) / len(parts),
                "acc2": float(acc[2]), "acc4": float(acc[min(4, self.cfg.block_size)]),
                "lr": self.opt.param_groups[0]["lr"]}

    # ---- evaluation, checkpoints, loop -----------------------------------------------------
    def evaluate(self) -> dict:
        self.drafter.eval()
        held = self.held[: self.cfg.eval_samples]
        r = acceptance_length(self.drafter, held, self.cfg.block_size)
        row = {"step": self.step, "accept_len": r.mean, "by_source": r.by_source,
               "by_position": [round(x, 4) for x in r.by_position], "num_blocks": r.num_blocks}
        if self.cfg.min_block_size:  # also at the smallest block it was trained for
            small = acceptance_length(self.drafter, held, self.cfg.min_block_size)
            row[f"accept_len_b{self.cfg.min_block_size}"] = small.mean
        self.drafter.train()
        return row

    def elapsed(self) -> float:
        """Training seconds over all invocations of this output folder."""
        return self.elapsed_before + time.monotonic() - self.t0

    def save(self) -> None:
        save_checkpoint(self.out, self.drafter, self.opt, self.step, self.gen, {
            "history": self.history, "config": asdict(self.cfg), "elapsed_s": self.elapsed(),
            "data_position": asdict(self.pos)})

    def _micro_batches(self):
        """Endless micro-batches from the saved data position; a new epoch re-reads the data
        folder (datagen may be adding shards meanwhile)."""
        spec = self.cfg.batch_spec
        while True:
            for pos, batch in iterate_batches(self.train_set, spec, self.cfg.seed, self.pos,
                                              self.gen):
                self.pos = pos
                yield batch
            self.train_set, self.held = split(load_samples(Path(self.cfg.data_dir)),
                                              self.cfg.heldout_every)
            self.pos = DataPosition(self.pos.epoch + 1, 0, 0)

    def _log(self, row: dict) -> None:
        self.history.append(row)
        with open(self.out / "history.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def _loop(self, stream, last_ckpt: float, session_start: float, asked) -> dict | None:
        """Steps until max_steps (-> None), or until the session's time is up or a stop was
        asked (SIGINT/SIGTERM: finish the step, save) -> why it stopped."""
        cfg = self.cfg
        while self.step < cfg.max_steps:
            row = self.train_step([next(stream) for _ in range(cfg.grad_accum)])
            row["elapsed_s"] = round(self.elapsed(), 1)
            if self.step % 10 == 0:
                self._log(row)
            if self.step % cfg.eval_every == 0:
                self._log(self.evaluate())
            over = bool(cfg.session_minutes and time.monotonic() - session_start
                        > 60 * cfg.session_minutes) or self.step == cfg.stop_at_step
            if time.monotonic() - last_ckpt > 60 * cfg.ckpt_minutes or over or asked():
                self.save()
                last_ckpt = time.monotonic()
            if over or asked():
                why = "signal" if asked() else "stop_at_step" if self.step == cfg.stop_at_step \
                    else "session_minutes"
                return {"step": self.step, "stopped": why}
        return None

    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = last_ckpt = session_start = time.monotonic()
        stream = self._micro_batches()
        self.drafter.train()
        if self.step == 0 and cfg.initial_eval:
            self._log(self.evaluate())
        with stop_requests() as asked:
            stopped = self._loop(stream, last_ckpt, session_start, asked)
        if stopped:
            return stopped
        final = self.evaluate()
        self._log(final)
        self.save()
        if cfg.export_to:
            export(self.out / DRAFTER, Path(cfg.export_to))
        return final


@contextlib.contextmanager
def stop_requests():
    """-> a function telling whether SIGINT or SIGTERM arrived; the loop then stops after the
    step in progress (never half-way through an optimiser update) and saves."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    old = {sig: signal.signal(sig, lambda n, _f: got.append(n))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(got)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if f.name == "layers":
            p.add_argument(flag, type=parse_layers, default=None, help="e.g. 0,1,2,29 (default: all)")
        elif f.name in CHOICES:
            p.add_argument(flag, choices=CHOICES[f.name], default=default)
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            kind = {"session_minutes": float, "stop_at_step": int}.get(f.name, str)
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
