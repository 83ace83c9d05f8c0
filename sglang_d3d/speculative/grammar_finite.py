"""Grammars whose language holds no finite string: `root ::= "a" root`, rules that only call each
other (`a ::= "x" b`, `b ::= "y" a`), a JSON schema whose every node requires a child of its own
kind. xgrammar compiles them, and constrained decoding then writes until `max_tokens`: an answer
that can never be whole. They are refused before compiling.

A rule is productive when some alternative of it is made only of productive parts: a string or
a character class, a repetition that may be empty (`*`, `?`, `{0, n}`), or a productive rule
(the least fixed point over the rules). The grammar can finish iff its root is productive. It is
read from xgrammar's own printed form of the grammar (`str(xgrammar.Grammar)`), so EBNF, regular
expressions and JSON schemas, after xgrammar's conversion and normalisation, are checked alike.
Constructs this reader does not know count as productive: a check that cannot tell lets the
grammar through, it never refuses a good one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\-]*) ::= ", re.MULTILINE)
_REPEAT = re.compile(r"\{\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\}")


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    least: int  # the fewest repetitions


TERMINAL = "terminal"  # a string, a character class, a lookahead, anything opaque: productive


def rules(printed: str) -> dict[str, object]:
    """xgrammar's printed grammar -> {rule name: its body as Seq/Alt/Repeat/Ref/TERMINAL}."""
    starts = list(_RULE.finditer(printed))
    out = {}
    for m, nxt in zip(starts, [*starts[1:], None]):
        body = printed[m.end() : nxt.start() if nxt else len(printed)]
        out[m.group(1)] = _Parser(body).parse()
    return out


def productive(grammar: dict[str, object]) -> set[str]:
    """The rules that derive some finite string (least fixed point)."""
    done: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in grammar.items():
            if name not in done and _yields(body, done, grammar):
                done.add(name)
                changed = True
    return done


def can_finish(printed: str, root: str = "root") -> bool:
    """Whether the grammar printed by xgrammar derives at least one finite string."""
    grammar = rules(printed)
    return root not in grammar or root in productive(grammar)


def _yields(node, done: set[str], grammar: dict) -> bool:
    if isinstance(node, Ref):
        return node.name in done or node.name not in grammar  # an unknown name: opaque
    if isinstance(node, Seq):
        return all(_yields(x, done, grammar) for x in node.items)
    if isinstance(node, Alt):
        return any(_yields(x, done, grammar) for x in node.options)
    if isinstance(node, Repeat):
        return node.least <= 0 or _yields(node.item, done, grammar)
    return True


class _Parser:
    """Recursive descent over one rule's body: alternatives of sequences of quantified atoms."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def parse(self):
        node = self._alt()
        return node

    def _skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._skip()
        return self.s[self.i] if self.i < len(self.s) else ""

    def _alt(self):
        options = [self._seq()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._seq())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def _seq(self):
        items = []
        while (c := self._peek()) and c not in "|)":
            items.append(self._quantified())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def _quantified(self):
        atom = self._atom()
        while True:
            c = self._peek()
            if c in ("*", "?"):
                self.i += 1
                atom = Repeat(atom, 0)
            elif c == "+":
                self.i += 1
                atom = Repeat(atom, 1)
            elif c == "{" and (m := _REPEAT.match(self.s, self.i)):
                self.i = m.end()
                atom = Repeat(atom, max(0, int(m.group(1))))
            else:
                return atom

    def _atom(self):
        c = self._peek()
        if c == '"':
            self.i = _quoted_end(self.s, self.i + 1, '"')
            return TERMINAL
        if c == "[":
            self.i = _quoted_end(self.s, self.i + 1, "]")
            return TERMINAL
        if c == "(":
            if self.s.startswith("(=", self.i):  # a lookahead assertion: consumes nothing
                self.i = _group_end(self.s, self.i)
                return TERMINAL
            self.i += 1
            node = self._alt()
            if self._peek() == ")":
                self.i += 1
            return node
        m = _NAME.match(self.s, self.i)
        if m is None:  # something unknown: step over it
            self.i += 1
            return TERMINAL
        self.i = m.end()
        if self.i < len(self.s) and self.s[self.i] == "(":  # Regex("..."), TagDispatch(...)
            self.i = _group_end(self.s, self.i)
            return TERMINAL
        return Ref(m.group(0))


def _quoted_end(s: str, i: int, close: str) -> int:
    while i < len(s) and s[i] != close:
        i += 2 if s[i] == "\\" else 1
    return i + 1


def _group_end(s: str, i: int) -> int:
    """The index after the parenthesis group opening at s[i], strings and classes skipped."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c == '"':
            i = _quoted_end(s, i + 1, '"')
            continue
        if c == "[":
            i = _quoted_end(s, i + 1, "]")
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i
