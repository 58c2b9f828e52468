"""A request's ``response_format`` (OpenAI's shape) as a grammar for the constraint engine.

* ``{"type": "text"}`` or None: no constraint.
* ``{"type": "json_object"}``: any JSON object.
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: a value that
  validates against the schema (``name`` and ``strict`` are accepted and change nothing).
* ``{"type": "regex", "regex": "..."}`` and ``{"type": "lark", "lark": "..."}``: text matching a regular
  expression or a Lark grammar (llguidance's dialect).

JSON formats take ``"whitespace"``: ``"flexible"`` (the default: any JSON whitespace between tokens, as
the JSON grammar allows) or ``"compact"`` (none: ``{"a":1}``), which leaves a model no room to wander
into whitespace and makes more of the answer forced (keys, punctuation).
"""

from __future__ import annotations

from llguidance import LLMatcher

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain.patterns import pattern_problem, schema_pattern_problem

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "lark")
WHITESPACE = ("flexible", "compact")


def grammar_for(response_format: dict | None) -> str | None:
    """The grammar ``response_format`` names (None: unconstrained text).  A malformed format is one
    line of :class:`EdgeSpecError`; whether the schema or grammar itself compiles is checked when a
    :class:`~edge_spec.runtime.constrain.Constraint` is made from it."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise EdgeSpecError(
            f'response_format must be an object such as {{"type": "json_object"}}, not {type(response_format).__name__}'
        )
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise EdgeSpecError(
            f"response_format type {kind!r} is not supported; choose one of: {', '.join(RESPONSE_FORMATS)}"
        )
    if kind == "text":
        return None
    if kind in ("regex", "lark"):
        source = response_format.get(kind)
        if not isinstance(source, str) or not source:
            raise EdgeSpecError(f"response_format {kind} needs the {kind} as a non-empty string in {kind!r}")
        if kind == "regex" and (problem := pattern_problem(source)) is not None:
            raise EdgeSpecError(f"response_format regex: {problem}")
        return LLMatcher.grammar_from_regex(source) if kind == "regex" else LLMatcher.grammar_from_lark(source)
    whitespace = response_format.get("whitespace", "flexible")
    if whitespace not in WHITESPACE:
        raise EdgeSpecError(f"response_format whitespace must be one of {', '.join(WHITESPACE)}, not {whitespace!r}")
    if kind == "json_object":
        schema: dict = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise EdgeSpecError("response_format json_schema needs the schema as an object in json_schema.schema")
        problem = self_reference(schema) or schema_pattern_problem(schema)
        if problem:
            raise EdgeSpecError(f"response_format json_schema.schema: {problem}")
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": whitespace == "flexible"})
    except (ValueError, TypeError) as exc:  # not serialisable as JSON
        raise EdgeSpecError(f"response_format json_schema.schema is not JSON ({first_line(exc)})") from None


# where JSON Schema keeps subschemas: one, a list of them, a map of names to them
ONE_SCHEMA = frozenset(
    {"items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
     "contains", "propertyNames", "not", "if", "then", "else"}
)  # fmt: skip
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas"})  # $defs: through a $ref


def self_reference(schema: dict) -> str | None:
    """Why no value can match ``schema`` when it holds a local ``$ref`` that leads back to itself through
    nothing but other references and ``allOf`` (``#/$defs/a`` -> ``#/$defs/b`` -> ``#/$defs/a``: each
    says "a value that matches the next", and none says anything else); None when it holds none.  The
    grammar engine compiles such a reference into a rule that matches nothing, and an answer would stop
    where it is used.  Only what is reachable from the root counts (a broken definition nothing uses is
    harmless), and a reference through ``properties``, ``items`` and the like is recursion, not a cycle."""
    edges: dict[str, list[str]] = {}  # pointer -> what the subschema there merely refers to
    pending = ["#"]
    while pending:
        pointer = pending.pop()
        if pointer in edges:
            continue
        node = _resolve(schema, pointer)
        if not isinstance(node, dict):
            continue
        edges[pointer] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = ref.rstrip("/") or "#"
            edges[pointer].append(target)
            pending.append(target)
        for key, value in node.items():
            children = []
            if key in ONE_SCHEMA and isinstance(value, dict):
                children = [f"{pointer}/{_escape(key)}"]
            elif key in SCHEMA_LISTS and isinstance(value, list):
                children = [f"{pointer}/{_escape(key)}/{i}" for i, item in enumerate(value) if isinstance(item, dict)]
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                children = [f"{pointer}/{_escape(key)}/{_escape(k)}" for k, v in value.items() if isinstance(v, dict)]
            pending.extend(children)
            if key == "allOf":
                edges[pointer].extend(children)
    done: set[str] = set()
    for start in edges:
        if start in done:
            continue
        path, stack = [start], [iter(edges[start])]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                done.add(path.pop())
                stack.pop()
            elif child in path:
                loop = " -> ".join(path[path.index(child) :] + [child])
                return f"the $ref chain {loop} refers only to itself, so no value matches it"
            elif child not in done and child in edges:
                path.append(child)
                stack.append(iter(edges[child]))
    return None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(schema: dict, pointer: str):
    """The value at a local JSON pointer (``#/$defs/a``), or None where there is none."""
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
