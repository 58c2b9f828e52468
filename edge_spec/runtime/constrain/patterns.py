"""A cheap static bound on what a regular expression costs the grammar engine, so that a pattern bomb is
refused before anything compiles it.

llguidance's lexer expands counted repetitions: ``a{1000}`` becomes a thousand states, and nested counts
multiply (``^(a{1000}){1000}$``: a million), which keeps it busy for seconds before it gives up.  A
child process with a time limit bounds that (:mod:`isolated`), but ending the child and starting
another costs a few seconds of CPU each time, which a server on two cores takes from every other
request.  :func:`expansion` reads a pattern without compiling it and counts the atoms it expands to,
each counted repetition multiplying its operand (``{n,}`` as ``n + 1`` copies, ``*``, ``+`` and ``?``
as one); :func:`pattern_problem` refuses a pattern past :data:`MAX_EXPANSION`.  Measured with a
150,000-token vocabulary, 250,000 literal atoms take llguidance about 1.7 s and a million fail after
3 s; 100,000 take about 0.3 s.  The reading is syntax-light on purpose: it follows escapes, classes,
groups, alternation and quantifiers the way every common regex dialect writes them, and anything it
does not recognise counts as one atom, so it never refuses a pattern for its dialect.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

MAX_EXPANSION = 100_000
CAP = 10**12  # counts stop growing here: deep nesting would otherwise make numbers of thousands of digits
_DIGITS = frozenset("0123456789")
_PLAIN = re.compile(r"[^\\\[\](){}|*+?^$]+")  # characters that are atoms of their own
# keys of JSON Schema whose values are data, not schemas (a "pattern" there is a value, not a regex)
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})


def _escape_end(pattern: str, start: int) -> int:
    """The index after the escape that starts at ``pattern[start] == '\\\\'`` (``\\p{L}``, ``\\x{41}``)."""
    end = start + 2
    if end <= len(pattern) and pattern[start + 1 : end] in ("p", "P", "x", "u", "N") and pattern[end : end + 1] == "{":
        close = pattern.find("}", end)
        return len(pattern) if close < 0 else close + 1
    return min(end, len(pattern))


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at ``pattern[start] == '['`` (nested classes and a
    leading ``]`` included)."""
    depth, i = 0, start
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i = _escape_end(pattern, i)
            continue
        if char == "[":
            depth += 1
            i += 1
            if pattern[i : i + 1] == "^":
                i += 1
            if pattern[i : i + 1] == "]":  # a leading ] is a member
                i += 1
            continue
        if char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(pattern)


def _counted(pattern: str, start: int) -> tuple[int, int] | None:
    """``(factor, end)`` for a ``{n}``, ``{n,}`` or ``{n,m}`` at ``start``; None when the brace is a literal."""
    close = pattern.find("}", start)
    if close < 0:
        return None
    low, comma, high = pattern[start + 1 : close].replace(" ", "").partition(",")
    if not low and comma and high and set(high) <= _DIGITS:  # {,m}: some dialects read it as {0,m}
        low = "0"
    if not low or not set(low) <= _DIGITS or (high and not set(high) <= _DIGITS):
        return None
    factor = int(high) if high else int(low) + (1 if comma else 0)
    return max(factor, 1), close + 1


def expansion(pattern: str) -> int:
    """How many atoms ``pattern`` expands to once its counted repetitions are written out (see the module
    docstring), at most :data:`CAP`; linear in the pattern's length."""
    groups: list[tuple[int, int, int]] = []  # per open group: (alternatives so far, current branch, last atom)
    total, branch, last = 0, 0, 0  # the current group's closed alternatives, open branch, operand of a quantifier
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i, atom = _escape_end(pattern, i), 1
        elif char == "[":
            i, atom = _class_end(pattern, i), 1
        elif char == "(":
            groups.append((total, branch, last))
            total, branch, last = 0, 0, 0
            i += 1
            if pattern[i : i + 1] == "?":  # (?:  (?P<name>  (?i)  (?=  : the prefix is no atom
                while i < len(pattern) and pattern[i] not in ":)>=!":
                    i += 1
                if i < len(pattern) and pattern[i] != ")":
                    i += 1
            continue
        elif char == ")":
            inner = total + branch
            if groups:
                total, branch, _ = groups.pop()
            else:  # an unbalanced ) is the engine's error to report; count on
                total, branch = 0, 0
            branch = min(branch + inner, CAP)
            last = inner
            i += 1
            continue
        elif char == "|":
            total, branch, last = min(total + branch, CAP), 0, 0
            i += 1
            continue
        elif char in "*+?":
            i += 1
            continue
        elif char == "{" and (counted := _counted(pattern, i)) is not None:
            factor, i = counted
            branch = min(branch + last * (factor - 1), CAP)
            last = min(last * factor, CAP)
            continue
        elif char in "^$":  # anchors match no character
            i, atom = i + 1, 0
        else:  # a run of plain characters at once: each is an atom, a quantifier takes the last
            plain = _PLAIN.match(pattern, i)  # none: a stray ] or }, or a { that is no count
            end = plain.end() if plain else i + 1
            branch, i, atom = min(branch + end - i - 1, CAP), end, 1
        branch += atom
        last = atom
    while groups:  # unclosed groups: counted as if closed at the end
        inner = total + branch
        total, branch, _ = groups.pop()
        branch = min(branch + inner, CAP)
    return min(total + branch, CAP)


def pattern_problem(pattern: str, limit: int = MAX_EXPANSION) -> str | None:
    """Why the grammar engine must not be given ``pattern`` (one line), or None."""
    size = expansion(pattern)
    if size <= limit:
        return None
    shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
    return (
        f"the pattern {shown!r} expands to {'more than ' if size >= CAP else ''}{size:,} repeated atoms (nested counted repetitions multiply); "
        f"at most {limit:,} are accepted"
    )


def schema_patterns(schema: object) -> Iterator[str]:
    """The regular expressions in a JSON schema: every ``pattern`` and the keys of ``patternProperties``
    (values under ``enum``, ``const`` and other data keywords are data)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _DATA_KEYS:
                continue
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            if isinstance(value, (dict, list)):
                pending.append(value)


def schema_pattern_problem(schema: object, limit: int = MAX_EXPANSION) -> str | None:
    """The first pattern of ``schema`` that :func:`pattern_problem` refuses, with the reason; None."""
    for pattern in schema_patterns(schema):
        problem = pattern_problem(pattern, limit)
        if problem is not None:
            return problem
    return None
