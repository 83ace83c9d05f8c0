"""Intra-op thread count of the calling thread, changed for a while."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(n: int | None):
    """Give the calling thread n intra-op threads for a while (None, or the count it has: leave
    as is). Used where one model runs alone in async mode (synchronous drafting, plain decoding
    cycles), so the cores set aside for the other model do not sit idle."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
