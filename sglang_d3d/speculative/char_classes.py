"""Character classes that match no character, found in regex and EBNF sources before compiling.

xgrammar refuses `[]` but serves `[^\\s\\S]`, `[^\\d\\D]` and `[^\\w\\W]`: its byte-level
matcher lets some multi-byte characters through a negated class that covers every code point,
so a regex that can match nothing produced text. A class that can match no character is always
a mistake, so such a source is refused whole (as xgrammar refuses `[]`), whether or not another
alternative could still match.

The escapes mean what they mean to xgrammar: `\\d` is [0-9], `\\w` is [a-zA-Z0-9_], `\\s` is
[\\f\\n\\r\\t\\v \\xa0], and the capitals are their complements.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

MAX_CODE_POINT = 0x10FFFF
Ranges = list[tuple[int, int]]  # inclusive code point ranges

_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0)]
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "b": "\b",
                 "e": "\x1b", "a": "\a"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def complement(ranges: Ranges) -> Ranges:
    """The code points not in `ranges` (sorted, non-overlapping)."""
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


def merged(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _escape(body: str, i: int) -> tuple[Ranges | int, int]:
    """The escape at body[i] (just after a backslash): a class's ranges or one code point,
    and the index after it."""
    c = body[i] if i < len(body) else "\\"
    if c.lower() in _CLASS_ESCAPES:
        ranges = _CLASS_ESCAPES[c.lower()]
        return (complement(ranges) if c.isupper() else ranges), i + 1
    if c in _HEX_DIGITS:
        digits = body[i + 1 : i + 1 + _HEX_DIGITS[c]]
        try:
            return int(digits, 16), i + 1 + len(digits)
        except ValueError:
            return ord(c), i + 1
    return ord(_CHAR_ESCAPES.get(c, c)), i + 1


def _atom(body: str, i: int) -> tuple[Ranges | int, int]:
    if body[i] == "\\":
        return _escape(body, i + 1)
    return ord(body[i]), i + 1


def class_ranges(body: str) -> tuple[bool, Ranges]:
    """A class's text between `[` and `]` -> (negated, the code points it lists)."""
    negated = body.startswith("^")
    i, ranges = int(negated), []
    while i < len(body):
        atom, i = _atom(body, i)
        if isinstance(atom, list):
            ranges += atom
            continue
        if i + 1 < len(body) and body[i] == "-":
            end, i = _atom(body, i + 1)
            if isinstance(end, int):
                ranges.append((atom, end))
                continue
            ranges += [(atom, atom), (ord("-"), ord("-")), *end]
            continue
        ranges.append((atom, atom))
    return negated, merged(ranges)


def matches_nothing(body: str) -> bool:
    negated, ranges = class_ranges(body)
    return ranges == [(0, MAX_CODE_POINT)] if negated else not ranges


def classes(source: str, ebnf: bool = False) -> Iterator[str]:
    """The bodies of the character classes in a regex (or an EBNF grammar: strings and
    comments skipped)."""
    i = 0
    while i < len(source):
        c = source[i]
        if c == "\\":
            i += 2
        elif ebnf and c == '"':
            i = _string_end(source, i + 1)
        elif ebnf and c == "#":
            end = source.find("\n", i)
            i = len(source) if end < 0 else end
        elif c == "[":
            end = _class_end(source, i + 1)
            yield source[i + 1 : end]
            i = end + 1
        else:
            i += 1


def _string_end(source: str, i: int) -> int:
    while i < len(source) and source[i] != '"':
        i += 2 if source[i] == "\\" else 1
    return i + 1


def _class_end(source: str, i: int) -> int:
    while i < len(source) and source[i] != "]":
        i += 2 if source[i] == "\\" else 1
    return min(i, len(source))


def empty_class(kind: str, source: str) -> str | None:
    """The first character class in a grammar source that matches no character, as `[...]`,
    or None. kind: "regex", "ebnf" or "json_schema" (its `pattern`s)."""
    if kind == "json_schema":
        patterns = _patterns(source)
    else:
        patterns = [source]
    for pattern in patterns:
        for body in classes(pattern, ebnf=kind == "ebnf"):
            if matches_nothing(body):
                return f"[{body}]"
    return None


def _patterns(source: str) -> list[str]:
    """Every `pattern` string in a JSON schema (an unreadable schema has none: the compiler
    says what is wrong with it)."""
    try:
        stack, out = [json.loads(source)], []
    except (ValueError, RecursionError):
        return []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append(node["pattern"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out
