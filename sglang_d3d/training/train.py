"""`d3d train`: distil the target's responses into a D3D block drafter.

Recipe (docs/drafter.md): start from the whole pretrained target (every layer, embedding and
head, shared and frozen) plus a learned mask embedding and zero low-rank deltas on mask slots;
train the deltas on the target's own responses with packed mask blocks (objective.py),
KL to the target's distribution (or CE on its greedy tokens), early drafts sampled more often.

Loop: batches (batches.py) -> clean pass without gradient, block pass with (forward.py) ->
loss (losses.py) -> gradients summed over processes (distributed.py) -> AdamW, warm-up +
cosine over `max_steps` -> held-out acceptance every `eval_every` steps (evaluate.py, rank 0)
-> checkpoint every `ckpt_minutes` (rank 0). Rerunning the same command (with the same number
of processes) resumes exactly: weights, optimiser, schedule, RNG and data position are in the
checkpoint. `max_minutes` stops (and saves) one invocation, so a long run may span several.

    d3d train --data-dir data/distill --out-dir runs/mine --target-path TARGET
    torchrun --nproc_per_node 8 -m sglang_d3d train --config recipes/configs/qwen3-8b-8gpu.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from sglang_d3d.training import distributed as dd
from sglang_d3d.training.batches import LAYOUT, DataPosition, iterate_batches, open_split
from sglang_d3d.training.build import build_drafter, load_target
from sglang_d3d.training.checkpoint import DRAFTER, export, latest_eval, load_state, save_checkpoint
from sglang_d3d.training.config_file import ConfigError
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.forward import (
    block_hidden,
    checkpoint_mlps,
    clean_pass,
    pick_rows,
    teacher_source,
)
from sglang_d3d.training.fsdp import FSDPUnavailable
from sglang_d3d.training.losses import (
    accuracy_from_hits,
    hits_by_draft,
    label_probs,
    slot_loss_rows,
)
from sglang_d3d.training.model_card import CardFacts, data_summary, render
from sglang_d3d.training.objective import IGNORE, chain_weights, draft_weights
from sglang_d3d.training.precision import Precision
from sglang_d3d.training.run_log import RunLog
from sglang_d3d.training.shards import crop
from sglang_d3d.training.stopping import stop_requests
from sglang_d3d.training.train_args import add_train_args, config_from_args, parse_layers
from sglang_d3d.training.train_config import CHOICES, TrainConfig, lr_at, seq_len_for

__all__ = ["CHOICES", "TrainConfig", "Trainer", "add_train_args", "config_from_args", "lr_at",
           "main", "parse_layers", "run_train"]


class Trainer:
    def __init__(self, cfg: TrainConfig, dist: dd.Dist | None = None, target=None) -> None:
        """target: an already built target Decoder (benchmarks at a shape with random
        weights); default: loaded from cfg.target_path."""
        from sglang_d3d.models.loading import resolve_dtype

        torch.set_num_threads(cfg.threads)
        self.dist = dist or dd.init(cfg.device)
        self.device = self.dist.device
        self.cfg, self.out = cfg, Path(cfg.out_dir)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.precision = Precision.for_target(self.dtype, self.device)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        # --fsdp: the target is read on the CPU, then each rank keeps its shards on its device
        if target is None:
            target = load_target(cfg.target_path, self.dtype, "cpu" if cfg.fsdp else self.device)
        self.target = target
        arch = self.target.arch
        self.max_seq_len = seq_len_for(cfg, int(arch.max_position), arch.sliding_window)
        self.spec = cfg.batch_spec(self.max_seq_len)
        if cfg.batch_size < self.dist.world:
            raise ValueError(f"--batch-size {cfg.batch_size} is below the {self.dist.world} "
                             "processes: each process needs at least one sequence per batch")
        self.train_set, self.held = open_split(Path(cfg.data_dir), cfg.heldout_every)
        if not len(self.train_set):
            raise ValueError(f"no training samples under {cfg.data_dir}")
        self.drafter = build_drafter(self.target, cfg.init_from, cfg.layers, cfg.block_size,
                                     cfg.rank, cfg.alpha, cfg.seed, cfg.min_block_size)
        if cfg.fsdp:
            self._shard()
        self.precision.keep_masters(self.drafter.trainable_parameters())
        if cfg.grad_checkpointing:
            checkpoint_mlps(self.drafter)
        self.opt = torch.optim.AdamW(self.drafter.trainable_parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step, self.history, self.elapsed_before = 0, [], 0.0
        self.last_eval: dict | None = None  # the latest evaluation (rank 0's row; None elsewhere)
        self.evaluated_at = -1  # its step, on every rank
        self.pos = DataPosition()
        self.t0 = time.monotonic()
        self.weights = draft_weights(cfg.block_size, cfg.gamma)
        self.log = RunLog(self.out, self.dist.is_main, cfg.tensorboard)
        state = load_state(self.out)
        if state is not None:
            self._resume(state)

    def _shard(self) -> None:
        from sglang_d3d.training.fsdp import place_unsharded, shard_target

        n = shard_target(self.target, self.dist)
        place_unsharded([self.target, self.drafter], self.device)
        if self.dist.is_main:
            print(f"fsdp: {n} target projections sharded over {self.dist.world} processes",
                  flush=True)

    def _resume(self, state: dict) -> None:
        self.drafter.load_own_state(state["model"])
        if "optimizer" in state:
            self.opt.load_state_dict(state["optimizer"])
        elif self.dist.is_main:  # a kept resume point: same schedule and data, fresh moments
            print(f"resuming at step {state['step']} without optimizer moments", flush=True)
        self.step, self.history = state["step"], state.get("history", [])
        self.elapsed_before = state.get("elapsed_s", 0.0)
        self.pos = DataPosition(**state["data_position"])
        self.gen.set_state(state["rng"])

    # ---- one step --------------------------------------------------------------------------
    def keep(self, labelled: torch.Tensor, keep_p: torch.Tensor, layout: list[int]) -> torch.Tensor:
        """[N, KM] bool: labelled slots, each kept in the loss with probability keep_p. The
        draws cover the whole global batch ([global rows, global slots]) on every rank, and
        each rank takes its rows, so any number of ranks keeps the same slots."""
        first, rows, slots = layout
        draw = torch.rand((rows, slots), generator=self.gen)
        n, km = keep_p.shape
        return labelled & (draw[first : first + n, :km].to(keep_p.device) < keep_p)

    @torch.no_grad()
    def teacher_logits(self, batch: dict, clean_h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[M, V] the target's logits at the slots picked by rows [N, KM] bool."""
        t_h = teacher_source(self.drafter, self.target, batch, clean_h)
        return self.drafter.logits(pick_rows(t_h, batch["slot_pos"], rows))

    def loss_rows(self, batch: dict, clean_h: torch.Tensor, layout: list[int] | None = None):
        """-> (sel [N, KM] bool: the slots in this step's loss, teacher [M, V] at them or None)."""
        labelled = batch["labels"] != IGNORE
        layout = layout or [0, *labelled.shape]
        if self.cfg.slot_weights == "position":
            keep_p = self.weights.to(labelled.device)[batch["slot_draft"]]
            sel = self.keep(labelled, keep_p, layout)
            kl = self.cfg.loss == "kl"
            return sel, self.teacher_logits(batch, clean_h, sel) if kl else None
        # confidence: the teacher at every labelled slot first, to weigh the chains
        scored = self.teacher_logits(batch, clean_h, labelled)  # [L, V]
        conf = torch.ones(labelled.shape, device=scored.device)
        conf[labelled] = label_probs(scored, batch["labels"][labelled])
        sel = self.keep(labelled, chain_weights(conf, batch["slot_draft"]), layout)
        return sel, scored[sel[labelled]]

    def micro_step(self, batch: dict) -> dict:
        """Forward one micro-batch (this rank's rows) -> its loss, already divided by the loss
        rows of the whole global batch (so gradients sum across ranks), and draft hits."""
        d = self.drafter
        layout = batch.pop(LAYOUT).tolist() if LAYOUT in batch else None
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.precision.autocast():
            past, clean_h = clean_pass(d, batch)
            sel, teacher = self.loss_rows(batch, clean_h, layout)
            student = d.logits(block_hidden(d, batch, past)[sel])  # [M, V]
            labels = batch["labels"][sel]
            rows = slot_loss_rows(student, teacher, labels, self.cfg.loss)  # [M]
        count = dd.all_sum(self.dist, torch.tensor(float(rows.numel()), device=self.device))
        loss = rows.sum() / count.clamp(min=1.0)
        hits = hits_by_draft(student, labels, batch["slot_draft"][sel], self.cfg.block_size)
        return {"loss": loss, "hits": hits}

    def train_step(self, batches: list[dict]) -> dict:
        """One optimiser step over grad_accum micro-batches; returns logged numbers."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        loss, hits = torch.zeros((), device=self.device), 0
        for batch in batches:
            out = self.micro_step(batch)
            (out["loss"] / len(batches)).backward()
            loss, hits = loss + out["loss"].detach(), hits + out["hits"]
        params = self.drafter.trainable_parameters()
        dd.sum_gradients(self.dist, params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        loss = float(dd.all_sum(self.dist, loss)) / len(batches)
        acc = accuracy_from_hits(dd.all_sum(self.dist, hits))
        return {"step": self.step, "loss": loss, "acc2": float(acc[2]),
                "acc4": float(acc[min(4, self.cfg.block_size)]),
                "lr": self.opt.param_groups[0]["lr"]}

    # ---- evaluation, checkpoints, loop -----------------------------------------------------
    @property
    def evaluates(self) -> bool:
        """Rank 0 evaluates; under --fsdp every rank runs it too (the sharded target gathers
        its weights from all ranks), and rank 0 logs it."""
        return self.dist.is_main or self.cfg.fsdp

    def evaluate(self) -> dict | None:
        if not self.evaluates:
            return None
        self.drafter.eval()
        held = [crop(s, self.max_seq_len) for s in self.held[: self.cfg.eval_samples]]
        with self.precision.autocast():
            r = acceptance_length(self.drafter, held, self.cfg.block_size)
            row = {"step": self.step, "accept_len": r.mean, "by_source": r.by_source,
                   "by_position": [round(x, 4) for x in r.by_position],
                   "num_blocks": r.num_blocks}
            if self.cfg.min_block_size:  # also at the smallest block it was trained for
                small = acceptance_length(self.drafter, held, self.cfg.min_block_size)
                row[f"accept_len_b{self.cfg.min_block_size}"] = small.mean
        self.drafter.train()
        return row

    def _evaluated(self) -> dict | None:
        """`evaluate()`, remembered with its step on every rank (all ranks agree on it)."""
        self.last_eval, self.evaluated_at = self.evaluate(), self.step
        return self.last_eval

    def _say_where(self) -> None:
        """One line on stderr: where the drafter is, and how to serve it."""
        if not self.dist.is_main:
            return
        where = self.cfg.export_to or str(self.out / DRAFTER)
        also = f" (and in {self.out / DRAFTER})" if self.cfg.export_to else ""
        print(f"d3d train: step {self.step}: the drafter is in {where}{also}; its model card "
              f"({where}/README.md) gives the command that serves it", file=sys.stderr,
              flush=True)

    def elapsed(self) -> float:
        """Training seconds over all invocations of this output folder."""
        return self.elapsed_before + time.monotonic() - self.t0

    def card(self, folder: Path) -> str:
        """The drafter folder's README.md (model_card.py), naming `folder` in its commands."""
        t, c = self.target, self.drafter.cfg
        facts = CardFacts(
            target=self.cfg.target_path or "HuggingFaceTB/SmolLM2-135M-Instruct",
            model_type=t.hf_config.model_type, num_layers=t.num_layers,
            vocab_size=t.arch.vocab_size, fingerprint=c.target_fingerprint,
            source_layers=c.source_layers,
            config={**asdict(self.cfg), "max_seq_len": self.max_seq_len},
            world=self.dist.world, step=self.step, elapsed_s=self.elapsed(),
            data=data_summary(Path(self.cfg.data_dir)), evaluation=latest_eval(self.history),
            default_target=self.cfg.target_path is None)
        return render(facts, str(folder))

    def save(self) -> None:
        if not self.dist.is_main:  # every rank holds the same state
            return
        save_checkpoint(self.out, self.drafter, self.opt, self.step, self.gen, {
            "history": self.history, "config": asdict(self.cfg), "elapsed_s": self.elapsed(),
            "data_position": asdict(self.pos)}, self.card(self.out / DRAFTER))

    def _micro_batches(self):
        """Endless micro-batches (this rank's share) from the saved data position; a new epoch
        re-reads the data folder (datagen may be adding shards meanwhile), cut to the samples
        every rank has seen."""
        while True:
            if not self.pos.num_samples:
                n = dd.agree_min(self.dist, len(self.train_set))
                self.pos = replace(self.pos, num_samples=n)
            for pos, batch in iterate_batches(self.train_set, self.spec, self.cfg.seed,
                                              self.pos, self.gen, self.dist.rank,
                                              self.dist.world):
                self.pos = pos
                yield batch
            self.train_set, self.held = open_split(Path(self.cfg.data_dir),
                                                   self.cfg.heldout_every)
            self.pos = DataPosition(self.pos.epoch + 1, 0, 0)

    def _log(self, row: dict | None) -> None:
        if row is None or not self.dist.is_main:
            return
        self.history.append(row)
        self.log.write(row)

    def _loop(self, stream, last_ckpt: float, start: float, asked) -> dict | None:
        """Steps until max_steps (-> None), or until this invocation's time is up or a stop
        was asked (SIGINT/SIGTERM: finish the step, save) -> why it stopped. Every rank
        agrees on stopping after the same step."""
        cfg = self.cfg
        while self.step < cfg.max_steps:
            row = self.train_step([next(stream) for _ in range(cfg.grad_accum)])
            row["elapsed_s"] = round(self.elapsed(), 1)
            if self.step % cfg.log_every == 0:
                self._log(row)
            if self.step % cfg.eval_every == 0:
                self._log(self._evaluated())
            late = bool(cfg.max_minutes and time.monotonic() - start > 60 * cfg.max_minutes)
            late, signalled = dd.agree(self.dist, [late, asked()])
            at_stop = self.step == cfg.stop_at_step
            if time.monotonic() - last_ckpt > 60 * cfg.ckpt_minutes or late or signalled \
                    or at_stop:
                self.save()
                last_ckpt = time.monotonic()
            if late or signalled or at_stop:
                why = "signal" if signalled else "stop_at_step" if at_stop else "max_minutes"
                return {"step": self.step, "stopped": why}
        return None

    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = last_ckpt = start = time.monotonic()
        stream = self._micro_batches()
        self.drafter.train()
        if self.step == 0 and cfg.initial_eval:
            self._log(self._evaluated())
        try:
            with stop_requests() as asked:
                stopped = self._loop(stream, last_ckpt, start, asked)
            if stopped:
                if self.dist.is_main:
                    print(f"d3d train: stopped at step {self.step} ({stopped['stopped']}); the "
                          f"checkpoint is in {self.out}: the same command resumes it",
                          file=sys.stderr, flush=True)
                return stopped
            # the last step's evaluation is the final one where the loop has just run it
            if self.evaluated_at != self.step:
                self._log(self._evaluated())
            final = self.last_eval
            self.save()
            if cfg.export_to and self.dist.is_main:
                export(self.out / DRAFTER, Path(cfg.export_to), self.card(Path(cfg.export_to)))
            self._say_where()
            return final if final is not None else {"step": self.step}
        finally:
            self.log.close()


def _refuse(e: Exception) -> int:
    """Settings that cannot work: one line, from the first process only (under torchrun every
    rank meets the same error; torchrun then reports the failed workers itself)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"d3d train: {e}", file=sys.stderr, flush=True)
    return 2


def run_train(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ConfigError, ValueError) as e:
        return _refuse(e)
    dist = dd.init(cfg.device)
    try:
        try:  # settings that cannot work are one line, before any step
            trainer = Trainer(cfg, dist)
        except (ValueError, FileNotFoundError, FSDPUnavailable) as e:
            return _refuse(e)
        final = trainer.run()
        dd.finish(dist)
    finally:
        dd.shutdown(dist)
    if dist.is_main and "accept_len" not in final:  # an evaluation is printed as it is logged
        print(json.dumps(final))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="d3d train", description=__doc__.splitlines()[0])
    add_train_args(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
