"""The text a drafter folder may carry beside its weights: the target's own answers it was
distilled on (`d3d corpus` writes it from `d3d datagen` shards), for the engine's copies
(speculative/corpus_lookup.py).

    corpus.npz   tokens_xz   every answer's ids concatenated [sum of lengths], as
                             little-endian token_dtype (uint16 or uint32) bytes under xz
                 lengths [S] int64, target_fingerprint: the target whose ids these are

xz because the corpus ships in the repository: it packs token ids about a quarter smaller
than the npz container's zlib. Folders written before keep a plain `tokens` array (zlib) and
still read.

Token ids mean nothing under another tokenizer, so a corpus written for another target is
refused, as the drafter's weights are.
"""

from __future__ import annotations

import lzma
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

CORPUS_FILE = "corpus.npz"


class CorpusFormatError(ValueError):
    pass


def write_corpus(folder: str | Path, answers: Sequence[np.ndarray], target_print: str) -> Path:
    """answers: token ids [R] each. Written via a temporary file, so a failed write never
    leaves half a corpus."""
    path = Path(folder) / CORPUS_FILE
    parts = [np.asarray(a, dtype=np.int64) for a in answers]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if tokens.size and tokens.min() < 0:
        raise CorpusFormatError("token ids must be >= 0")
    dtype = np.uint16 if not tokens.size or tokens.max() <= np.iinfo(np.uint16).max else np.uint32
    little = np.dtype(dtype).newbyteorder("<")
    tmp = path.with_name(CORPUS_FILE + ".tmp.npz")
    np.savez_compressed(tmp, tokens_xz=np.frombuffer(pack_tokens(tokens, little), np.uint8),
                        token_dtype=np.array(little.str),
                        lengths=np.array([len(a) for a in answers], dtype=np.int64),
                        target_fingerprint=np.array(target_print))
    os.replace(tmp, path)
    return path


def read_corpus(folder: str | Path, target_print: str) -> list[np.ndarray] | None:
    """The folder's answers [R] int64 each, or None where it has no corpus. Raises
    CorpusFormatError for another target's corpus or an unreadable file."""
    path = Path(folder) / CORPUS_FILE
    if not path.exists():
        return None
    try:
        with np.load(path) as z:
            tokens, lengths = _tokens(z), z["lengths"]
            written_for = str(z["target_fingerprint"])
    except (OSError, ValueError, KeyError, lzma.LZMAError) as e:
        raise CorpusFormatError(
            f"{path}: not a corpus (needs tokens, lengths and target_fingerprint; delete it to "
            f"run without one): {e!r}") from None
    if written_for != target_print:
        raise CorpusFormatError(f"{path} holds another target's token ids (fingerprint "
                                f"{written_for}, this target {target_print}): write it again "
                                f"with `d3d corpus`, or delete it")
    if int(lengths.sum()) != len(tokens) or (lengths < 0).any():
        raise CorpusFormatError(f"{path}: lengths add up to {int(lengths.sum())}, not the "
                                f"{len(tokens)} tokens it holds")
    return np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []


def pack_tokens(tokens: np.ndarray, dtype) -> bytes:
    """tokens [N] -> xz of their bytes as `dtype` (the most compact preset: written once, read
    at every load, and xz reads fast at any preset)."""
    raw = np.ascontiguousarray(tokens, dtype=dtype).tobytes()
    return lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)


def unpack_tokens(blob: bytes, dtype: str) -> np.ndarray:
    """pack_tokens' inverse: [N] int64."""
    return np.frombuffer(lzma.decompress(blob), dtype=np.dtype(dtype)).astype(np.int64)


def _tokens(z) -> np.ndarray:
    if "tokens_xz" in z.files:
        return unpack_tokens(z["tokens_xz"].tobytes(), str(z["token_dtype"]))
    return z["tokens"].astype(np.int64)  # files written before the xz format (zlib)


def first_tokens(answers: Sequence[np.ndarray], limit: int) -> list[np.ndarray]:
    """The answers in order while they fit in `limit` tokens (a cap on the engine's memory)."""
    out, total = [], 0
    for a in answers:
        if total + len(a) > limit:
            break
        out.append(a)
        total += len(a)
    return out
