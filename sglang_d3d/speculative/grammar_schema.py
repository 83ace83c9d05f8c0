"""JSON schemas held exactly, or refused: the keywords xgrammar's converter drops or loosens.

xgrammar turns a schema into a grammar, and what it cannot express it leaves out: `not`,
`if`/`then`/`else`, `uniqueItems`, `dependentRequired` and `allOf` of several schemas are
ignored, so an answer to `{"allOf": [{"type": "string"}, {"type": "integer"}]}` came out as
`true`; `oneOf` is read as `anyOf`; an `enum` ignores the `type` beside it, a `$ref` or an
`anyOf` the keywords beside them; `maxLength` is dropped beside a `pattern`; a `required`
property that `properties` does not list is never written. Each of these would let a 200
carry an answer that fails the user's schema, so a schema that uses one is refused, naming the
keyword and where it is (a JSON pointer).

What the converter keeps may narrow the schema, never widen it: objects hold only the listed
properties unless `additionalProperties` says otherwise, and `pattern` must match the whole
string. Every answer then still validates. Keywords JSON Schema defines as annotations
(`title`, `description`, `default`, `examples`, `format` without a format checker...), and
keywords it does not define, change no validation and pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

# Assertions the converter does not hold: refused wherever they appear (with the value that
# makes them a no-op let through).
DROPPED = {
    "not": "`not` (no schema can be excluded)",
    "if": "`if`/`then`/`else`",
    "then": "`if`/`then`/`else`",
    "else": "`if`/`then`/`else`",
    "dependentRequired": "`dependentRequired`",
    "dependentSchemas": "`dependentSchemas`",
    "dependencies": "`dependencies`",
    "contains": "`contains`",
    "minContains": "`minContains`",
    "maxContains": "`maxContains`",
    "additionalItems": "`additionalItems` (use `prefixItems` and `items`)",
    "unevaluatedItems": "`unevaluatedItems`",
    "$dynamicRef": "`$dynamicRef`",
    "$recursiveRef": "`$recursiveRef`",
}
NO_OP = {"uniqueItems": False, "unevaluatedProperties": False, "unevaluatedItems": False}
# The keywords that constrain a value (beside `$ref`, `anyOf`, `oneOf`, `enum` or `const`
# the converter would drop them).
ASSERTIONS = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf",
    "oneOf", "allOf", "$ref", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "uniqueItems", *DROPPED,
}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMAS = ("additionalProperties", "items", "propertyNames", "not", "if", "then", "else",
              "contains", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}


class Unsupported(NamedTuple):
    keyword: str
    where: str  # a JSON pointer into the schema
    why: str

    def message(self) -> str:
        return f"`{self.keyword}` at {self.where or '#'}: {self.why}"


def unsupported(schema) -> Unsupported | None:
    """The first keyword of `schema` that xgrammar would not hold exactly, or None."""
    for where, node in _nodes(schema, "#"):
        if (found := _node_problem(node, where)) is not None:
            return found
    return None


def _nodes(schema, where: str) -> Iterator[tuple[str, dict]]:
    """Every subschema (dicts only; `true` and `false` are the converter's own business)."""
    stack = [(where, schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(f"{where}/{key}/{_escape(k)}", v) for k, v in node[key].items()]
        for key in SUBSCHEMAS:
            if key in node:
                stack.append((f"{where}/{key}", node[key]))
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(f"{where}/{key}/{i}", v) for i, v in enumerate(node[key])]


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _node_problem(node: dict, where: str) -> Unsupported | None:
    for key, why in DROPPED.items():
        if key in node and not (key in NO_OP and node[key] == NO_OP[key]):
            return Unsupported(key, where, f"{why} is not supported in structured output")
    if node.get("uniqueItems") not in (None, False):
        return Unsupported("uniqueItems", where, "`uniqueItems` is not supported in "
                           "structured output")
    if node.get("unevaluatedProperties") not in (None, False):
        return Unsupported("unevaluatedProperties", where, "only `unevaluatedProperties: "
                           "false` is supported")
    for check in (_types, _combinators, _beside_ref, _values, _strings, _numbers, _required):
        if (found := check(node, where)) is not None:
            return found
    return None


def _declared_types(node: dict) -> set[str] | None:
    t = node.get("type")
    if t is None:
        return None
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else None


def _types(node: dict, where: str) -> Unsupported | None:
    if node.get("type") == []:  # other malformed types: the converter says what is wrong
        return Unsupported("type", where, "an empty list of types: no value could match")
    return None


def _others(node: dict, *own: str) -> list[str]:
    return sorted(k for k in node if k in ASSERTIONS and k not in own)


def _combinators(node: dict, where: str) -> Unsupported | None:
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) != 1:
        return Unsupported("allOf", where, "`allOf` of several schemas is not supported: merge "
                           "them into one schema")
    if isinstance(all_of, list) and _others(node, "allOf"):
        return Unsupported("allOf", where, f"`allOf` beside {_others(node, 'allOf')} is not "
                           "supported: merge them into one schema")
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if not isinstance(options, list):
            continue
        if not options:
            return Unsupported(key, where, f"an empty `{key}`: no value could match")
        if _others(node, key):
            return Unsupported(key, where, f"`{key}` beside {_others(node, key)} is not "
                               f"supported: move them into each branch of `{key}`")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and not _pairwise_disjoint(one_of):
        return Unsupported("oneOf", where, "`oneOf` whose branches may both match is not "
                           "supported (it is held as `anyOf`): use `anyOf`, or branches of "
                           "distinct types or with a distinct `const` on a required property")
    return None


def _pairwise_disjoint(options: list) -> bool:
    return all(_disjoint(a, b) for i, a in enumerate(options) for b in options[i + 1 :])


def _disjoint(a, b) -> bool:
    """Whether no value can match both (a sufficient check: distinct types, or a required
    property with distinct constants, a tagged union's tag)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    ta, tb = _declared_types(a), _declared_types(b)
    if ta and tb:
        widen = lambda t: t | {"number"} if "integer" in t else t  # noqa: E731
        if not widen(ta) & widen(tb):
            return True
    for name in set(a.get("required", [])) & set(b.get("required", [])):
        ca, cb = _tag(a, name), _tag(b, name)
        if ca is not None and cb is not None and not ca & cb:
            return True
    return False


def _tag(node: dict, name: str) -> set | None:
    prop = (node.get("properties") or {}).get(name)
    if not isinstance(prop, dict):
        return None
    if "const" in prop:
        return {repr(prop["const"])}
    if isinstance(prop.get("enum"), list):
        return {repr(v) for v in prop["enum"]}
    return None


def _beside_ref(node: dict, where: str) -> Unsupported | None:
    if "$ref" in node and _others(node, "$ref"):
        return Unsupported("$ref", where, f"`$ref` beside {_others(node, '$ref')} is not "
                           "supported: the referenced schema alone would be held; move them "
                           "into it")
    return None


def _values(node: dict, where: str) -> Unsupported | None:
    for key in ("enum", "const"):
        if key not in node:
            continue
        values = node[key] if key == "enum" else [node[key]]
        if not isinstance(values, list):
            return None  # the converter refuses it
        extra = _others(node, "enum", "const", "type")
        if extra:
            return Unsupported(key, where, f"`{key}` beside {extra} is not supported: list "
                               "only values that match them")
        types = _declared_types(node)
        bad = [v for v in values if types and not types & _json_types(v)]
        if bad:
            return Unsupported(key, where, f"{bad[0]!r} does not match `type` {node['type']!r}")
    return None


def _json_types(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _strings(node: dict, where: str) -> Unsupported | None:
    if "pattern" in node:
        for key in ("minLength", "maxLength", "format"):
            if key in node:
                return Unsupported(key, where, f"`{key}` beside `pattern` is not supported "
                                   "(the pattern alone would be held): write the length into "
                                   "the pattern")
    return None


def _numbers(node: dict, where: str) -> Unsupported | None:
    step = node.get("multipleOf")
    if step is None:
        return None
    if _declared_types(node) != {"integer"} or not isinstance(step, int) or step < 1:
        return Unsupported("multipleOf", where, "`multipleOf` is supported only as a positive "
                           "integer on `type: integer`")
    return None


def _required(node: dict, where: str) -> Unsupported | None:
    required = node.get("required")
    if not isinstance(required, list):
        return None
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [name for name in required if name not in listed]
    if missing:
        closed = node.get("additionalProperties") is False
        why = ("`additionalProperties` is false, so no object can match" if closed else
               "it would never be written: list it in `properties`")
        return Unsupported("required", where, f"required property {missing[0]!r} is not in "
                           f"`properties`; {why}")
    return None
