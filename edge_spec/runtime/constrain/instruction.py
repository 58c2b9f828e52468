"""The schema of a ``response_format`` shown to the model, as OpenAI's API promises.

OpenAI documents ``json_schema.description`` as "used by the model to determine how to respond in the
format": the model is told the format, not only held to it.  A grammar alone forces the keys but leaves
the model guessing what they are for and how long a list should run: a greedy answer can then fill an
array until ``max_tokens`` and never close it.  So a chat request with a JSON schema gets one system
instruction naming the schema (its name and description too), or the first user message where the chat
template refuses a system message; the grammar still decides what may be emitted.  ``json_object``,
``regex`` and ``lark`` formats add nothing (OpenAI asks the caller to say "JSON" in the messages for
``json_object``), nor do raw-text prompts, which the caller writes whole.
"""

from __future__ import annotations

import json

from edge_spec.runtime.constrain.constraint import Constraint


def schema_instruction(response_format: dict | Constraint | None) -> str | None:
    """The instruction for ``response_format``, or for the format a compiled constraint was read from
    (None: nothing to show; a malformed format is refused by ``grammar_for``, not here)."""
    if isinstance(response_format, Constraint):
        response_format = response_format.response_format
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return None
    name = spec.get("name")
    heading = "Answer in JSON that follows this JSON schema" + (f" ({name})" if isinstance(name, str) and name else "")
    lines = [heading + ":"]
    description = spec.get("description")
    if isinstance(description, str) and description.strip():
        lines.append(description.strip())
    lines.append(json.dumps(spec["schema"], ensure_ascii=False))
    return "\n".join(lines)


def with_instruction(messages: list[dict], instruction: str | None, into_user: bool = False) -> list[dict]:
    """``messages`` with ``instruction`` at the end of the leading system message (one is added in front
    where there is none), so every chat template places it where it places system text; ``into_user``:
    in front of the first user message instead, for templates that refuse a system message.  The
    caller's list is left as it was."""
    if not instruction:
        return messages
    if into_user:
        for index, message in enumerate(messages):
            if message.get("role") == "user" and isinstance(message.get("content"), str):
                joined = f"{instruction}\n\n{message['content']}"
                return [*messages[:index], {**message, "content": joined}, *messages[index + 1 :]]
        return [{"role": "user", "content": instruction}, *messages]
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        system = messages[0]["content"]
        joined = f"{system.rstrip()}\n\n{instruction}" if system.strip() else instruction
        return [{**messages[0], "content": joined}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]
