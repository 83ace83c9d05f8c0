"""Request fields -> the engine's SamplingParams, with the limits OpenAI's API enforces."""

from __future__ import annotations

from sglang_d3d.server.errors import bad_request
from sglang_d3d.server.protocol import SamplingFields

from sglang_d3d.config import SamplingParams


def eos_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def output_budget(
    requested: int | None, prompt_len: int, max_context: int, prompt_param: str
) -> int:
    """max_tokens, checked against the context; None means "up to the end of the context"."""
    if prompt_len >= max_context:
        raise bad_request(
            f"the prompt is {prompt_len} tokens; this model's context length is {max_context}",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return max_context - prompt_len
    if prompt_len + requested > max_context:
        raise bad_request(
            f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the context "
            f"length ({max_context})",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def sampling_params(fields: SamplingFields, max_new_tokens: int, tokenizer) -> SamplingParams:
    top_k = fields.top_k or 0
    return SamplingParams(
        temperature=1.0 if fields.temperature is None else fields.temperature,  # OpenAI's default
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=max(0, top_k),  # -1 (vLLM's "off") and 0 both disable top-k
        seed=fields.seed,
        max_new_tokens=max_new_tokens,
        stop_token_ids=eos_ids(tokenizer),
    )
