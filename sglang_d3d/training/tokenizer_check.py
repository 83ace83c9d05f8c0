"""Before any generation: does the server's model share the target folder's tokenizer?

Datagen tokenizes prompts here and stores the server's answers as ids of the target folder's
vocabulary, so a server running another tokenizer would yield data that is silently wrong.
Three probes, each a request of one or a few tokens, through the same route the run uses:
  vocabulary  the target's largest token id is accepted as a prompt (a smaller vocabulary
              refuses it)
  counts      the server tokenizes each probe string into as many tokens as the target does
  greedy      the probe string sent as text and as the target's ids gets the same first token,
              and where ids come back, they decode (in context) to the text the server sent
"""

from __future__ import annotations

from sglang_d3d.training.datagen_server import BadRequest, ServerClient

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def area(r):\n    return 3.14159 * r ** 2",
    "Total: 1,234.50 EUR (+19% VAT) — ça coûte 數學",
)


class TokenizerMismatch(ValueError):
    """The server's model tokenizes differently from the target folder; one-line message."""


def probe_texts(tok) -> list[str]:
    """Fixed strings, plus text decoded from ids spread over the whole vocabulary (so the high
    ids that only a large vocabulary has are checked too)."""
    n = len(tok)
    spread = [n * k // 9 for k in range(1, 9)] + [n - 1]
    decoded = tok.decode(spread, skip_special_tokens=True)
    return [*PROBE_TEXTS, decoded] if decoded.strip() else list(PROBE_TEXTS)


def _same(a: str, b: str) -> bool:
    """Equal up to surrounding space and U+FFFD: a token that ends inside a UTF-8 character
    decodes to U+FFFD alone, where a server's incremental detokenizer holds it back ('')."""
    def norm(t: str) -> str:
        return t.replace("\ufffd", "").strip()

    return norm(a) == norm(b)


async def check_tokenizer(client: ServerClient, tok) -> None:
    """Raises TokenizerMismatch naming the first probe that differs."""
    top = len(tok) - 1
    try:
        await client.complete([top], 1)
    except BadRequest as e:
        raise TokenizerMismatch(
            f"the server's model refuses token id {top} of the target's vocabulary "
            f"({len(tok)} tokens): not the target's tokenizer ({e})"
        ) from e
    for text in probe_texts(tok):
        await _check_text(client, tok, text)


async def _check_text(client: ServerClient, tok, text: str) -> None:
    ids = tok(text)["input_ids"]  # with special tokens, as a server tokenizes a text prompt
    as_text = await client.complete(text, 1)
    if as_text.prompt_tokens is not None and as_text.prompt_tokens != len(ids):
        raise TokenizerMismatch(
            f"the server tokenizes {text[:40]!r} into {as_text.prompt_tokens} tokens, the "
            f"target folder's tokenizer into {len(ids)}: not the target's tokenizer"
        )
    as_ids = await client.complete(ids, 1)
    if not _same(as_text.text, as_ids.text):
        raise TokenizerMismatch(
            f"the same probe as text and as the target's token ids gets different answers "
            f"({as_text.text!r} vs {as_ids.text!r}): not the target's tokenizer"
        )
    if as_ids.token_ids:
        ours = decode_after(tok, ids, as_ids.token_ids)
        if not _same(ours, as_ids.text):
            raise TokenizerMismatch(
                f"the server's token ids {as_ids.token_ids} read {as_ids.text!r} on the server "
                f"and {ours!r} with the target folder's tokenizer: not the target's tokenizer"
            )


def decode_after(tok, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt`, as a server's incremental detokenizer writes it
    (a token's leading space depends on what precedes it)."""
    head = tok.decode(prompt, skip_special_tokens=True)
    whole = tok.decode(list(prompt) + list(new), skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else tok.decode(new, skip_special_tokens=True)
