"""Continuous-batching generation with the engine's own target runner.

Why not `transformers.generate`: a static batch runs until its longest response ends, and on this
data responses range from 30 to 256 tokens, so a third of the compute goes to finished rows.
Here a finished row frees its cache slot and the next prompt is prefilled into it at once. Using
the engine's `TargetRunner` also makes the greedy responses exactly what the engine's target
computes, which is what the offline acceptance-length evaluation assumes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from sglang_d3d.models.target import TargetRunner


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> [N] token ids: argmax (temperature 0) or a sample."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def generate_continuous(
    target,  # models.decoder.Decoder
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    num_slots: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    on_done: Callable[[int], None] | None = None,
) -> list[tuple[list[int], bool]]:
    """[(response ids incl. EOS, finished)] in prompt order."""
    max_prompt = max(len(p) for p in prompts)
    runner = TargetRunner(target, num_slots, max_prompt + max_new_tokens + 1)
    gen = torch.Generator().manual_seed(seed)
    todo = deque(range(len(prompts)))
    free, active = list(range(num_slots - 1, -1, -1)), {}  # active: slot -> prompt index
    out: list[list[int]] = [[] for _ in prompts]
    results: list[tuple[list[int], bool] | None] = [None] * len(prompts)

    def emit(slot: int, tok: int) -> None:
        i = active[slot]
        out[i].append(tok)
        done = tok in eos_ids
        if done or len(out[i]) >= max_new_tokens:
            results[i] = (out[i], done)
            del active[slot]
            runner.free(slot)
            free.append(slot)
            if on_done is not None:
                on_done(i)

    while todo or active:
        while free and todo:  # refill freed slots before the next decode step
            slot, i = free.pop(), todo.popleft()
            active[slot] = i
            emit(slot, int(pick(runner.prefill(slot, prompts[i]).unsqueeze(0), temperature, gen)))
        if not active:
            continue
        slots = sorted(active)
        last = torch.tensor([[out[active[s]][-1]] for s in slots])  # [N, 1]
        logits = runner.forward_block(slots, last)[:, -1]  # [N, V]
        for s in slots:
            runner.advance(s, 1)
        for s, tok in zip(slots, pick(logits, temperature, gen).tolist(), strict=True):
            emit(s, tok)
    return results  # type: ignore[return-value]
