"""What an export is doing at this moment, and what it leaves on disk if it stops now, for whoever
watches it from outside.

Why: a process that the system's out-of-memory killer ends says nothing (the shell prints ``Killed``);
the command that started it can say what was being built, if it knows.  The export says each of its
steps (:class:`edge_spec.export.bundle.stages.Stages` does), and inside the long ones where it is (a layer of
the graph, a stage of the drafter heads); :mod:`edge_spec.export.bundle.watchdog` forwards each change from
the process doing the work to the command watching it.  With nobody listening a change costs one
function call.
"""

from __future__ import annotations

from collections.abc import Callable

_listener: Callable[[str, str], None] | None = None
_step: str | None = None


def listen(listener: Callable[[str, str], None] | None) -> None:
    """Send every change to ``listener(kind, text)``: kind "doing" (what the export does now) or "kept"
    (what is on disk if it stops now); None stops."""
    global _listener
    _listener = listener


def step(name: str) -> None:
    """The export begins the step ``name`` ("building the target graph")."""
    global _step
    _step = name
    _tell("doing", name)


def detail(text: str) -> None:
    """Where the current step is ("layer 17 of 28"): said as the step followed by ``text``."""
    _tell("doing", f"{_step} ({text})" if _step else text)


def kept(text: str) -> None:
    """What is on disk should the work stop now ("nothing was written to ...")."""
    _tell("kept", text)


def _tell(kind: str, text: str) -> None:
    if _listener is not None:
        _listener(kind, text)
