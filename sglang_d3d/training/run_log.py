"""Training logs: JSON lines (history.jsonl and stdout), and TensorBoard when it is installed
(`pip install '.[tensorboard]'` in a clone; `tensorboard --logdir OUT_DIR/tensorboard`).
Only rank 0 writes either."""

from __future__ import annotations

import json
from pathlib import Path


def tensorboard_writer(folder: Path):
    """A SummaryWriter on `folder`, or None where tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


def scalars(row: dict) -> dict[str, float]:
    """The numbers of one log row as TensorBoard tags: train rows under train/, evaluations
    under eval/, acceptance per draft position as eval/accept_pos_<d>."""
    group = "eval" if "accept_len" in row else "train"
    out = {}
    for key, value in row.items():
        if key == "by_position":
            out.update({f"eval/accept_pos_{d}": v for d, v in enumerate(value, start=1)})
        elif key == "by_source":
            out.update({f"eval/accept_len_source_{s}": v for s, v in value.items()})
        elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{group}/{key}"] = float(value)
    return out


class RunLog:
    def __init__(self, out: Path, enabled: bool, tensorboard: bool) -> None:
        self.out, self.enabled = out, enabled
        self.writer = tensorboard_writer(out / "tensorboard") if enabled and tensorboard else None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.out / "history.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        if self.writer is not None:
            for tag, value in scalars(row).items():
                self.writer.add_scalar(tag, value, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
