"""Token ids -> text, one token at a time, with stop strings applied.

Decoding uses the tokenizers library's DecodeStream, which buffers tokens that end inside a
multi-byte character. It is primed with the end of the prompt so that the first generated
token decodes in context (e.g. keeps its leading space), as a full decode would.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_d3d.server.stop_strings import StopMatcher
from tokenizers.decoders import DecodeStream

PRIME_TOKENS = 4  # prompt tokens replayed into the decoder; enough for any merge context


class TextStream:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream drives
        self._decoder = DecodeStream(ids=list(prompt_ids[-PRIME_TOKENS:]), skip_special_tokens=True)
        self._stops = StopMatcher(stops)
        self.decoded = 0  # characters decoded so far, stop strings aside: the next token's offset

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller ends the request and sends no more text."""
        return self._stops.stopped

    def add(self, token_id: int) -> str:
        """Text that became final with this token (possibly empty)."""
        piece = self._decoder.step(self._backend, token_id)
        self.decoded += len(piece or "")
        return self._stops.feed(piece) if piece else ""

    def finish(self) -> str:
        """Text held back for a possible stop string that never completed."""
        return self._stops.flush()
