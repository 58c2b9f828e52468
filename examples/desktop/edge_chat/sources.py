"""Token sources and their colours, read from the chat page's stylesheet so that the window and the page
colour a token the same way (one place to change them).

A source is what :meth:`edge_spec.runtime.engine.Engine.generate` hands to ``on_sources`` for each token:
"target", or the proposer whose accepted draft it was ("model", "eagle", "lookup", "suffix", "forced",
"guess"; see :mod:`edge_spec.runtime.provenance`).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import edge_spec

STYLESHEET = Path(edge_spec.__file__).resolve().parent / "server" / "static" / "style.css"

#: the legend, in the chat page's order: the colour key (a CSS ``--src-KEY`` variable), its label and what it means
LEGEND = (
    ("model", "drafter model", "drafted by the small drafter model (or the EAGLE head) and accepted by the target"),
    (
        "lookup",
        "copied",
        "copied from earlier text, this chat's earlier answers or the prompt, and accepted by the target",
    ),
    ("forced", "grammar", "the only token a grammar allowed, drafted as such and accepted by the target"),
    ("guess", "free guess", "guessed without a model in a pass's spare row, and accepted by the target"),
    (
        "target",
        "target",
        "chosen by the target model itself: the first token, a correction where a draft was refused, "
        "or the token each pass adds after the accepted drafts",
    ),
)
#: under the legend: what the colours do not say
LEGEND_NOTE = (
    "The target model checks every token, so the answer is the one it would write alone; "
    "the colour says only who proposed each token."
)

_VARIABLE = re.compile(r"--src-([\w-]+)\s*:\s*(#[0-9a-fA-F]{3,8})\s*;")
_RULE = re.compile(r"((?:\.src-[\w-]+\s*,?\s*)+)\{\s*background\s*:\s*var\(--src-([\w-]+)\)")


@cache
def source_colours() -> dict[str, str]:
    """Each source's background colour (``#rrggbb``), as the chat page's ``.src-SOURCE`` rules give it."""
    css = STYLESHEET.read_text(encoding="utf-8")
    variables = dict(_VARIABLE.findall(css))
    colours: dict[str, str] = {}
    for selectors, variable in _RULE.findall(css):
        for source in re.findall(r"\.src-([\w-]+)", selectors):
            colours[source] = variables[variable]
    missing = [key for key, *_ in LEGEND if key not in colours]
    if missing:
        raise RuntimeError(f"{STYLESHEET} has no colour for the token sources {', '.join(missing)}")
    return colours


def colour_of(source: str) -> str | None:
    """The background of a token from ``source`` (None: a source the page does not colour)."""
    return source_colours().get(source)
