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
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": whitespace == "flexible"})
    except (ValueError, TypeError) as exc:  # not serialisable as JSON
        raise EdgeSpecError(f"response_format json_schema.schema is not JSON ({first_line(exc)})") from None


def first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
