"""The settings of `d3d train`, one frozen dataclass: every field is a flag and a config key."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_d3d.training.batches import BatchSpec
from sglang_d3d.training.objective import SLOT_WEIGHTS

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
    batch_size: int = 4  # global: sequences per micro-batch over all processes
    grad_accum: int = 1
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 1000
    max_minutes: float | None = None  # stop (and save) this invocation after this long
    stop_at_step: int | None = None  # stop (and save) at this step; the schedule still ends
    # at max_steps (equal-step comparisons of losses or formats over one schedule)
    heldout_every: int = 20  # every n-th prompt index is held out
    eval_every: int = 100
    log_every: int = 10  # a training row in the log every n steps
    eval_samples: int = 40
    ckpt_minutes: float = 5.0
    max_seq_len: int | None = None  # None: the target's context length
    dtype: str = "auto"  # auto: fp32 on CPUs without bf16 matrix units, bf16 on GPUs
    device: str = "cpu"
    fsdp: bool = False  # shard the frozen target's projections across processes
    grad_checkpointing: bool = False  # recompute each drafter layer's MLP in the backward pass
    tensorboard: bool = True  # also log to <out_dir>/tensorboard when tensorboard is installed
    threads: int = 1
    seed: int = 0
    export_to: str | None = None  # copy the final drafter folder here
    initial_eval: bool = True  # evaluate the untrained drafter first (off: arms sharing a start)

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("block_size >= 2, batch_size >= 1 and grad_accum >= 1 required")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be one of {', '.join(allowed)}, "
                                 f"not {getattr(self, name)!r}")
        if self.max_seq_len is not None and self.max_seq_len < 4:
            raise ValueError("--max-seq-len must be at least 4")

    def batch_spec(self, max_seq_len: int) -> BatchSpec:
        return BatchSpec(self.block_size, self.num_anchors, self.min_block_size, max_seq_len,
                         self.batch_size)


HELP = {
    "data_dir": "datagen output folder (shards + manifest.json)",
    "out_dir": "checkpoints, history.jsonl and the drafter folder; rerunning resumes from it",
    "target_path": "the target's HF folder (default: SmolLM2-135M-Instruct)",
    "init_from": "start from this drafter folder instead of zero deltas",
    "layers": "target layers the drafter runs, e.g. 0,1,2,29 (default: all)",
    "block_size": "the largest block trained: anchor + block_size - 1 mask slots",
    "min_block_size": "above 0: each block's size is drawn in [min, block_size]",
    "num_anchors": "mask blocks per training sequence",
    "rank": "rank of the low-rank deltas",
    "alpha": "delta scale numerator (scale = alpha / rank)",
    "loss": "kl: KL to the target's distribution; ce: cross-entropy on its greedy tokens",
    "gamma": "draft d enters the loss with probability exp(-(d-1)/gamma)",
    "slot_weights": "position: weigh drafts by position; confidence: by the target's "
                    "confidence in the block's earlier drafts",
    "batch_size": "sequences per micro-batch over all processes (each takes its share)",
    "grad_accum": "micro-batches per optimiser step",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine schedule ends at lr * min_lr_ratio",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps",
    "max_steps": "optimiser steps of the whole schedule",
    "max_minutes": "stop and save this invocation after this many minutes (rerun to resume)",
    "stop_at_step": "stop and save at this step; the schedule still ends at max_steps",
    "heldout_every": "every Nth datagen record is held out for evaluation",
    "eval_every": "held-out acceptance every N steps",
    "log_every": "write a training row (loss, accuracy, lr) every N steps",
    "eval_samples": "held-out samples per evaluation",
    "ckpt_minutes": "save a checkpoint at least this often",
    "max_seq_len": "crop sequences to this many tokens (default: the target's context)",
    "dtype": "auto: bf16 on GPUs (fp32 master weights, autocast), fp32 on most CPUs",
    "device": "cpu or cuda (under torchrun: each process takes cuda:LOCAL_RANK)",
    "fsdp": "shard the frozen target's projections across processes (torchrun)",
    "grad_checkpointing": "recompute each drafter layer's MLP in the backward pass",
    "tensorboard": "also log to OUT_DIR/tensorboard when tensorboard is installed",
    "threads": "CPU threads per process",
    "seed": "random seed (weights' init, data order, anchors, sampled loss rows)",
    "export_to": "copy the final drafter folder (with its README.md) here",
    "initial_eval": "evaluate the untrained drafter before the first step",
}


def seq_len_for(cfg: TrainConfig, context: int, window: int | None = None) -> int:
    """--max-seq-len, or the target's context length `context`; refused above the context.
    A target with a sliding attention `window` trains no longer than the window: the target's
    passes compute full attention, which equals the windowed one only inside it."""
    limit, what = (window, "attention window") if window and window < context else (context, "context")
    if cfg.max_seq_len is not None and cfg.max_seq_len > limit:
        raise ValueError(f"--max-seq-len {cfg.max_seq_len} is beyond the target's {what} "
                         f"({limit})")
    return cfg.max_seq_len or limit


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps.
    A pure function of the step, so a resumed run continues the same schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))
