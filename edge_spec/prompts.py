"""Prompt files: one JSON object per line, ``{"category": str, "prompt": str | chat messages}``.

The bench prompts and the head-training prompt set share this format, so they share its reader and
its one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge_spec.errors import EdgeSpecError


def read_prompt_file(path, what: str = "prompt") -> list[dict]:
    """The file's records, each checked: a ``category`` string and a non-empty ``prompt`` that is text
    or a list of ``{"role", "content"}`` messages.  ``what`` names the file in errors."""
    path = Path(path)
    if not path.is_file():
        raise EdgeSpecError(f"{what} file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise EdgeSpecError(f"{path} line {number}: invalid JSON ({exc})") from None
        if not (isinstance(item, dict) and isinstance(item.get("category"), str) and _is_prompt(item.get("prompt"))):
            raise EdgeSpecError(
                f"{path} line {number}: expected an object with a 'category' string and a "
                "non-empty 'prompt' (text or chat messages)"
            )
        prompts.append(item)
    if not prompts:
        raise EdgeSpecError(f"{what} file {path} has no prompts")
    return prompts


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """A record's prompt as chat messages (text is one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _is_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt)
    )
