"""Size limits checked before any work: JSON nesting, and grammar sources before compiling.

xgrammar's compile time grows much faster than a schema's size: measured on one core with an
8k-token vocabulary, 100 properties compiled in 1 s, 300 in 5 s and 1,000 in 60 s (a 350 MB
compiled grammar); 30 enum strings of 1,000 characters took 7 s. The compile time limit
(speculative/grammar_pool.py) bounds every compile; these checks refuse the obvious cases at once, with a
message that says which limit to stay under.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from sglang_d3d.config import GrammarSpec
from sglang_d3d.speculative.char_classes import empty_class

TOO_LARGE, TOO_DEEP = "grammar_too_large", "json_too_deep"  # error codes


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024  # a grammar's source (a schema as JSON)
    max_depth: int = 64  # JSON nesting (request bodies, schemas); brackets of a regex or EBNF
    max_enum: int = 1024  # enum and const values in a schema, all together
    max_properties: int = 256  # object properties in a schema, all together

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_depth, self.max_enum, self.max_properties) < 1:
            raise ValueError("grammar limits must be >= 1")


def json_depth_over(value, limit: int) -> bool:
    """Whether decoded JSON nests deeper than `limit` (`[]` and `{}` are depth 1). Walks with a
    list, not recursion, and stops at the first container past the limit."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        items = node.values() if isinstance(node, dict) else node
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return False


def bracket_depth(source: str, ebnf: bool = False) -> int:
    """The deepest nesting of ( [ { in a regex or EBNF source, escapes (and EBNF's quoted
    strings) skipped."""
    depth = deepest = 0
    skip = quoted = False
    for c in source:
        if skip:
            skip = False
        elif c == "\\":
            skip = True
        elif ebnf and c == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
    return deepest


def schema_counts(schema) -> tuple[int, int]:
    """(enum and const values, object properties) over a whole schema."""
    values = properties = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                values += len(node["enum"])
            if "const" in node:
                values += 1
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return values, properties


class Problem(NamedTuple):
    code: str  # the error's `code`
    message: str


def check_source(spec: GrammarSpec, limits: GrammarLimits) -> Problem | None:
    """What is wrong with a grammar's source before compiling it, or None."""
    size = len(spec.source.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        return Problem(TOO_LARGE, f"the {spec.kind} is {size} bytes, over this server's limit "
                       f"of {limits.max_bytes} (--max-grammar-bytes)")
    if spec.kind == "json_schema":
        problem = _schema_problem(spec.source, limits)
    elif bracket_depth(spec.source, spec.kind == "ebnf") > limits.max_depth:
        problem = Problem(TOO_DEEP, f"the {spec.kind} nests brackets deeper than this "
                          f"server's limit of {limits.max_depth} (--max-json-depth)")
    else:
        problem = None
    if problem is None and (found := empty_class(spec.kind, spec.source)):
        problem = Problem("grammar_matches_nothing", f"the character class {found} matches "
                          "no character, so nothing can match")
    return problem


def _schema_problem(source: str, limits: GrammarLimits) -> Problem | None:
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError):
        return None  # the compiler says what is wrong with it
    if json_depth_over(schema, limits.max_depth):
        return Problem(TOO_DEEP, f"the schema nests deeper than this server's limit of "
                       f"{limits.max_depth} (--max-json-depth)")
    values, properties = schema_counts(schema)
    if values > limits.max_enum:
        return Problem(TOO_LARGE, f"the schema has {values} enum and const values, over this "
                       f"server's limit of {limits.max_enum} (--max-schema-enum)")
    if properties > limits.max_properties:
        return Problem(TOO_LARGE, f"the schema has {properties} properties, over this "
                       f"server's limit of {limits.max_properties} (--max-schema-properties)")
    return None
