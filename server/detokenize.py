"""Token ids -> text, one token at a time, with stop strings applied.

Decoding uses the tokenizers library's DecodeStream, which buffers tokens that end inside a
multi-byte character. It is primed with the end of the prompt so that the first generated
token decodes in context (e.g. keeps its leading space), as a full decode would.

Stop strings: cut at the first match, and never stream a partial match. Text that could still
turn into a stop string (a suffix that is a prefix of one) is held back until the next piece
settles it, so a streaming client never sees text that the final answer leaves out. The stop
string itself is not part of the output, as in OpenAI's API. With vLLM's `min_tokens`, stop
strings are looked for only in the text decoded after the first `min_tokens` tokens (which is
released as it comes).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

PRIME_TOKENS = 4  # prompt tokens replayed into the decoder; enough for any merge context


class TextStream:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stops: Sequence[str],
                 min_tokens: int = 0) -> None:
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream drives
        self._decoder = DecodeStream(ids=list(prompt_ids[-PRIME_TOKENS:]), skip_special_tokens=True)
        self._stops = StopMatcher(stops)
        self._unarmed = min_tokens  # tokens still to come before stop strings count
        self.decoded = 0  # characters decoded so far, stop strings aside: the next token's offset

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller ends the request and sends no more text."""
        return self._stops.stopped

    def add(self, token_id: int) -> str:
        """Text that became final with this token (possibly empty)."""
        piece = self._decoder.step(self._backend, token_id)
        self.decoded += len(piece or "")
        if self._unarmed > 0:
            self._unarmed -= 1
            return self._stops.skip(piece) if piece else ""
        return self._stops.feed(piece) if piece else ""

    def finish(self) -> str:
        """Text held back for a possible stop string that never completed."""
        return self._stops.flush()


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Earliest index at which a stop string occurs in `text`, searching from `start`."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Feed text pieces; get back the part that is safe to release."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything fed so far (cut at the stop string once matched)
        self.released = 0  # chars of self.text handed out
        self.floor = 0  # a match starts at or after this (text before min_tokens is exempt)
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        # A match can start at most longest-1 chars before the new piece.
        start = max(self.floor, len(self.text) - self.longest + 1)
        self.text += piece
        hit = find_stop(self.text, self.stops, start) if self.stops else None
        if hit is not None:
            self.text, self.stopped = self.text[:hit], True
            return self._release(len(self.text))
        return self._release(len(self.text) - partial_stop_len(self.text, self.stops))

    def skip(self, piece: str) -> str:
        """Text no stop string may match (before `min_tokens`): released whole, and a later
        match starts after it."""
        self.text += piece
        self.floor = len(self.text)
        return self._release(len(self.text))

    def flush(self) -> str:
        """At the end of generation a held-back partial match is plain text after all."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out, self.released = self.text[self.released : upto], upto
        return out
