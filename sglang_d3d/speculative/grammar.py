"""Structured output: an answer kept inside a grammar (a JSON schema, a regular expression, an
EBNF grammar), compiled by xgrammar for the target's tokenizer.

Plain constrained decoding masks, at each step, the tokens the grammar refuses after the output
so far, and picks from the rest. Why verification stays exact: row j of a chain's verify logits
scores the token after drafts d_1..d_j, so it is masked with the grammar's state after the
output plus d_1..d_j. The matcher walks the drafts, fills one mask row a step, and is rolled
back. A draft the grammar refuses ends the walk: its own logit is masked out in the row before,
so it is rejected (greedy: it is not the argmax; sampled: it has probability zero), and no
later row can be reached. A token tree's rows are filled the same way along each node's path.
Drafts and copies are proposals, and verification is exact for any proposal; the drafter's
slots are still masked along its likeliest allowed path (`steer`), so that it proposes nothing
the grammar refuses.

Only the request's accepted tokens enter its matcher (`advance`), so a rejected draft leaves no
trace. Cost, measured for the default target's 49,152-token vocabulary on one core: the mask
rows of an 8-token verify row 0.17 ms and applying them 0.19 ms (xgrammar's kernel), steering
8 drafter slots 1.7 ms, against cycles of 70-130 ms (benchmarks/results/README.md).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial

import torch

from sglang_d3d.config import GrammarSpec
from sglang_d3d.speculative.grammar_finite import can_finish
from sglang_d3d.speculative.grammar_schema import unsupported
from sglang_d3d.speculative.tree import DraftTree

log = logging.getLogger(__name__)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # xgrammar's mask kernel takes
# Compiled grammars kept for reuse: a server may see any number of distinct schemas, and
# xgrammar's cache is unbounded by default. One compiled for the default target's vocabulary
# measured 15-46 KB, so this keeps about a thousand.
CACHE_BYTES = 64 << 20
_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


class GrammarError(ValueError):
    """A grammar that does not compile, or an answer it cannot continue. `code`: the error
    code a server sends with it (None: a source that does not compile)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


UNSUPPORTED, NEVER_ENDS = "schema_unsupported", "grammar_never_ends"  # GrammarError codes


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # the plain install has it (scripts/setup.sh); a bare pip may not
        raise GrammarError("structured output needs the xgrammar package "
                           "(pip install -r scripts/requirements-grammar.txt --no-deps)") from e
    return xgrammar


class Grammars:
    """Compiles grammars for one tokenizer, and keeps those compiled elsewhere (`adopt`: a
    server compiles in worker processes it can stop, grammar_pool.py)."""

    def __init__(self, info) -> None:  # info: xgrammar.TokenizerInfo
        self._compiler = _xgrammar().GrammarCompiler(info, max_threads=1,
                                                      cache_limit_bytes=CACHE_BYTES)
        self.info = info
        self.vocab_size = info.vocab_size
        self._adopted = _Adopted(CACHE_BYTES)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Grammars:
        """`vocab_size`: the model's (its logits may have more rows than the tokenizer)."""
        info = _xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        return cls(info)

    @classmethod
    def for_pieces(cls, pieces: Sequence[str], stop_ids: Sequence[int]) -> Grammars:
        """A vocabulary given as each token's raw text (tests; simple tokenizers)."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo(list(pieces), vocab_type=xgr.VocabType.RAW,
                                 vocab_size=len(pieces), stop_token_ids=sorted(stop_ids))
        return cls(info)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; a GrammarError naming what is wrong with the source."""
        return self._adopted.get(spec) or compile_source(self._compiler, spec)

    def has(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled already (adopted; xgrammar's own cache is not asked)."""
        return self._adopted.get(spec) is not None

    def adopt(self, spec: GrammarSpec, serialized: str) -> None:
        """Keep a grammar compiled elsewhere for this tokenizer (CompiledGrammar's JSON)."""
        compiled = _xgrammar().CompiledGrammar.deserialize_json(serialized, self.info)
        self._adopted.put(spec, compiled)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        return Constraint(_xgrammar().GrammarMatcher(self.compile(spec)), self.vocab_size)


def compile_source(compiler, spec: GrammarSpec):
    """`spec` compiled by an xgrammar.GrammarCompiler; a GrammarError naming what is wrong,
    also for a schema xgrammar would not hold exactly (grammar_schema.py) and a grammar that
    no finite answer matches (grammar_finite.py)."""
    check_source(spec)
    # JSON without free whitespace: where any amount is allowed, small models fill answers
    # with blank lines (the tiny test models did, at every prompt). The separators are
    # json.dumps' own, ", " and ": ".
    build = {"json_schema": partial(compiler.compile_json_schema, any_whitespace=False),
             "regex": compiler.compile_regex, "ebnf": compiler.compile_grammar}[spec.kind]
    try:
        return build(spec.source)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"invalid {spec.kind}: {_WHERE.sub('', str(e)).strip()}") from e


def check_source(spec: GrammarSpec) -> None:
    """A GrammarError for a schema held inexactly or a grammar that cannot finish; a source
    that does not parse passes (the compiler then says what is wrong with it)."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except (ValueError, RecursionError):
            return
        if (found := unsupported(schema)) is not None:
            raise GrammarError(f"the json_schema cannot be held exactly: {found.message()}",
                               UNSUPPORTED)
    if spec.kind == "regex":  # no rule can call itself: a regex always has a finite match
        return
    xgr = _xgrammar()
    try:
        grammar = (xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
                   if spec.kind == "json_schema" else xgr.Grammar.from_ebnf(spec.source))
    except (RuntimeError, ValueError, TypeError):
        return
    if not can_finish(str(grammar)):
        what = ("every object it allows requires another inside it" if spec.kind == "json_schema"
                else "its `root` rule cannot end: every alternative calls itself again")
        raise GrammarError(f"the {spec.kind} matches no finite answer ({what}); decoding "
                           "would never finish", NEVER_ENDS)


class _Adopted:
    """Adopted compiled grammars, least recently used dropped first past `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit, self._size = limit, 0
        self._items: OrderedDict[GrammarSpec, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()  # adopted on a server's worker threads, read anywhere

    def get(self, spec: GrammarSpec):
        with self._lock:
            item = self._items.get(spec)
            if item is None:
                return None
            self._items.move_to_end(spec)
            return item[0]

    def put(self, spec: GrammarSpec, compiled) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            old = self._items.pop(spec, None)
            self._size += size - (old[1] if old else 0)
            self._items[spec] = (compiled, size)
            while self._size > self._limit and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self._size -= dropped


def tokenizer_grammars(tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Grammars | None:
    """The engine's compiler, or None (logged) where xgrammar is missing: the server then
    serves everything but structured output, which it refuses with a 400."""
    try:
        return Grammars.for_tokenizer(tokenizer, vocab_size, stop_ids)
    except GrammarError as e:
        log.warning("structured output is off: %s", e)
        return None


class Constraint:
    """One request's grammar state: a matcher that has read its accepted output."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def chain(self, drafts: Sequence[int]) -> torch.Tensor:
        """[G+1, W] int32 bitmask: row j allows what the grammar allows after drafts[:j]."""
        out = _xgrammar().allocate_token_bitmask(len(drafts) + 1, self.vocab_size)  # all allowed
        taken = 0  # one walk down the chain, a row filled at each step
        for j in range(len(drafts) + 1):
            if self._m.is_terminated():
                break
            self._m.fill_next_token_bitmask(out, j)
            if j == len(drafts) or not self._m.accept_token(drafts[j]):
                break
            taken += 1
        if taken:
            self._m.rollback(taken)
        return _checked(out)

    def tree(self, tree: DraftTree) -> torch.Tensor:
        """[M+1, W] int32 bitmask: row i allows what the grammar allows after node i's path."""
        paths: list[list[int]] = [[]]  # the root's
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            paths.append(paths[parent] + [token])
        return self._rows(paths)

    def steer(self, logits: torch.Tensor, after: Sequence[int] = ()) -> torch.Tensor:
        """[B, V] drafter logits for the B slots after the output plus `after` (tokens not
        yet advanced), each masked with the grammar's state along the path of the likeliest
        allowed tokens before it, so that no draft the grammar refuses is proposed. Exactness
        does not rest on it (any proposal is exact), so it never raises: where the grammar has
        nothing to say, the logits stay as they are."""
        out = logits.clone()
        taken = self._walk(list(after))
        row = _xgrammar().allocate_token_bitmask(1, self.vocab_size)
        for j in range(out.shape[0] if taken == len(after) else 0):
            if self._m.is_terminated():
                break
            self._m.fill_next_token_bitmask(row, 0)
            if not row.any():
                break
            out[j : j + 1] = constrain(out[j : j + 1], row)
            if not self._m.accept_token(int(out[j].argmax())):
                break
            taken += 1
        if taken:
            self._m.rollback(taken)
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """The request accepted `tokens` (masked, so the grammar allows them)."""
        for t in tokens:
            if not self._m.accept_token(t):
                raise GrammarError(f"token {t} is outside the grammar: this vocabulary cannot "
                                   "continue the answer inside it")

    def _rows(self, paths: list[list[int]]) -> torch.Tensor:
        """Row r: the grammar's mask after `paths[r]`. A row the grammar cannot reach (a
        refused token on its path, or its end already passed) allows everything: its token is
        rejected before it, and a row with no token left would break sampling."""
        out = _xgrammar().allocate_token_bitmask(len(paths), self.vocab_size)  # all allowed
        for r, path in enumerate(paths):
            taken = self._walk(path)
            if taken == len(path) and not self._m.is_terminated():
                self._m.fill_next_token_bitmask(out, r)
            if taken:
                self._m.rollback(taken)
        return _checked(out)

    def _walk(self, path: list[int]) -> int:
        """Accept `path` up to a token the grammar refuses or its end: how many were taken."""
        for i, t in enumerate(path):
            if self._m.is_terminated() or not self._m.accept_token(t):
                return i
        return len(path)


def _checked(bitmask: torch.Tensor) -> torch.Tensor:
    """The answer so far must have a continuation (row 0). A later row with none is a dead
    end behind drafts; it allows everything, and `advance` reports the dead end if the
    target's token leads there."""
    if not bitmask[0].any():
        raise GrammarError("the grammar allows no token of this vocabulary here")
    bitmask[1:][~bitmask[1:].any(-1)] = -1
    return bitmask


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab] bool: bit b of word w allows token 32 w + b."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]


def constrain(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """[R, V] logits with every token the mask refuses at -inf (a new tensor; any dtype)."""
    if bitmask is None:
        return logits
    if logits.dtype in _KERNEL_DTYPES:  # xgrammar's kernel: 2-3x faster than unpacking here
        out = logits.clone()
        _xgrammar().apply_token_bitmask_inplace(out, bitmask.to(out.device))
        return out
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]).to(logits.device), float("-inf"))
