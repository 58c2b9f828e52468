"""The ``long`` bench category: code files an agent or an editor sends whole, to edit, explain or test.

Agents and editor extensions send a file of a few thousand tokens with a short instruction; the prompt,
not the answer, then sets the time to the first token, and an edit's answer repeats the file.  The short
bench prompts show neither.  These prompts are built, not shipped: each is a class or module of Python's
standard library (``inspect.getsource``, present wherever this Python runs) cut to :data:`CHAR_BUDGET`
characters at a definition boundary, fenced, after its instruction.  The same Python gives the same
prompts; another Python version's sources may differ, so a record names the Python it came from.

:data:`CHAR_BUDGET` puts every prompt at 1,500-3,000 tokens of the Qwen2.5 tokenizer (4-5 characters a
token on this code), chat template included.

Standard library only, like the rest of :mod:`edge_spec.bench`.
"""

from __future__ import annotations

import importlib
import inspect
import platform
import re

from edge_spec.errors import EdgeSpecError

CATEGORY = "long"
CHAR_BUDGET = 10_000  # of code per prompt: 2,000-2,600 Qwen2.5 tokens on the sources below
# (module, object in it, instruction): two edits, two test suites, two explanations
SOURCES = (
    (
        "textwrap",
        "TextWrapper",
        "Add type hints to every method of this class (parameters and return values) without changing "
        "its behaviour, and return the complete edited code.",
    ),
    (
        "fractions",
        "Fraction",
        "Write pytest unit tests for this class: construction from integers, strings, floats and "
        "decimals, normalisation of signs and common factors, limit_denominator, and the errors raised "
        "on bad input.",
    ),
    (
        "difflib",
        "SequenceMatcher",
        "Explain how this class finds matching blocks: what find_longest_match computes, how the junk "
        "heuristic works, and what ratio() returns.",
    ),
    (
        "html.parser",
        "HTMLParser",
        "Rename the method goahead to _process_buffer, update every call to it, and return the complete edited code.",
    ),
    (
        "csv",
        "Sniffer",
        "Write unittest tests for this class that check the detected delimiter, quote character and "
        "header for a few small CSV samples.",
    ),
    (
        "graphlib",
        "TopologicalSorter",
        "Explain what this class does, how prepare, get_ready and done work together, and when it raises CycleError.",
    ),
)
# a line where a definition starts, at the top level or in a class: the excerpt ends before one
_DEFINITION = re.compile(r"^(?:    )?(?:@|def |async def |class )")


def excerpt(source: str, budget: int = CHAR_BUDGET) -> str:
    """The longest run of ``source``'s first lines within ``budget`` characters that ends before a
    definition (a decorator, ``def`` or ``class`` at the top level or in a class, and the comment lines
    right above it), so that an excerpt holds whole methods; the whole source when it fits; a cut at a
    line when no definition starts within the budget."""
    if len(source) <= budget:
        return source.rstrip() + "\n"
    lines = source.splitlines(keepends=True)
    size, line_cut, definition_cut = 0, 0, 0  # size: of lines[:index], within the budget
    for index, line in enumerate(lines):
        if index and _DEFINITION.match(line) and not lines[index - 1].lstrip().startswith("@"):
            definition_cut = index  # a decorator stays with what it decorates
        if size + len(line) > budget:
            break
        size += len(line)
        line_cut = index + 1
    cut = definition_cut or line_cut
    while definition_cut and cut > 1 and lines[cut - 1].lstrip().startswith("#"):
        cut -= 1  # the comment above a definition goes with it
    return "".join(lines[:cut]).rstrip() + "\n"


def long_prompts(budget: int = CHAR_BUDGET) -> list[dict]:
    """The category's prompts, in :data:`SOURCES` order: ``{"category", "prompt", "source"}``, the prompt
    one user message (the instruction, then the code in a fence).  A Python without its library's
    sources (a frozen build) raises :class:`EdgeSpecError` in one line."""
    version = platform.python_version()
    prompts = []
    for module_name, name, instruction in SOURCES:
        try:
            source = inspect.getsource(getattr(importlib.import_module(module_name), name))
        except (OSError, TypeError) as error:
            raise EdgeSpecError(
                f"the {CATEGORY!r} bench prompts need Python's library sources ({module_name}.py): {error}"
            ) from None
        code = excerpt(source, budget)
        path = module_name.replace(".", "/") + ".py"
        prompts.append(
            {
                "category": CATEGORY,
                "prompt": f"{instruction}\n\n```python\n# {path}\n{code}```",
                "source": f"{module_name}.{name} (Python {version}, {len(code)} of {len(source)} characters)",
            }
        )
    return prompts
