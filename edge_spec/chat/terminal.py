"""Reading the chat's messages.

On a terminal (:class:`TerminalInput`, prompt_toolkit): Enter sends; Alt-Enter (Esc then Enter) or a
line ending in a backslash starts a new line; a paste is one message however many lines it has (the
terminal's bracketed paste); Ctrl-C clears the line, Ctrl-D on an empty line leaves.  What is sent is
kept between runs in :func:`history_file` (the arrow keys recall it).

Anywhere else (:class:`PlainInput`: a pipe, a file) each line is a message, and a line ending in a
backslash goes on on the next one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import platformdirs
from rich.console import Console

from edge_spec.chat.commands import line_continues
from edge_spec.errors import os_error_line
from edge_spec.paths import APP, home

PROMPT = ">>> "
CONTINUATION = "... "


def state_dir() -> Path:
    """edge-spec's user state: ``$EDGE_SPEC_HOME`` when set, else the platform's user state directory
    (``platformdirs.user_state_dir("edge-spec")``: ``~/.local/state/edge-spec`` on Linux)."""
    root = home()
    return root if root is not None else platformdirs.user_state_path(APP, appauthor=False)


def history_file() -> Path:
    """Where the chat keeps the messages typed on a terminal."""
    return state_dir() / "chat_history"


def _warn(line: str) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/yellow] {line}", highlight=False)


def _private_history(path: Path, warn: Callable[[str], None]):
    """A history in ``path``, readable by its owner only; when it cannot be made, read or written: one
    warning, and a history for this run alone."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    class PrivateHistory(FileHistory):
        broken = False

        def store_string(self, string: str) -> None:
            if self.broken:
                return
            try:
                super().store_string(string)
            except OSError as exc:  # a full disk, say: the chat goes on
                self.broken = True
                warn(f"chat history not saved ({os_error_line(exc)})")

    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
        with open(path, "rb"):
            pass
    except OSError as exc:
        warn(f"chat history not kept ({os_error_line(exc)})")
        return InMemoryHistory()
    return PrivateHistory(str(path))


def _key_bindings():
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("enter")
    @bindings.add("c-j")  # a newline byte: what a pipe-like writer sends for Enter
    def _send(event) -> None:
        buffer = event.current_buffer
        if line_continues(buffer.document.current_line_before_cursor):
            buffer.delete_before_cursor(1)
            buffer.newline(copy_margin=False)
        else:
            buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    def _new_line(event) -> None:
        event.current_buffer.newline(copy_margin=False)

    @bindings.add("c-c")
    def _clear(event) -> None:
        event.current_buffer.reset()

    return bindings


class TerminalInput:
    """The line editor on a terminal (see the module docstring)."""

    def __init__(
        self, history: str | os.PathLike | None = None, *, input=None, output=None, warn: Callable[[str], None] = _warn
    ) -> None:
        from prompt_toolkit import PromptSession

        self.session = PromptSession(
            history=_private_history(Path(history or history_file()), warn),
            multiline=True,
            key_bindings=_key_bindings(),
            prompt_continuation=[("ansicyan", CONTINUATION)],
            input=input,
            output=output,
            enable_open_in_editor=False,
            mouse_support=False,
        )

    def read(self) -> str | None:
        """The next message; None: the user left (Ctrl-D)."""
        while True:
            try:
                # coloured: a plain trailing space is not drawn, and a reader of the screen waits for ">>> "
                return self.session.prompt([("ansicyan", PROMPT)])
            except EOFError:
                return None
            except KeyboardInterrupt:  # a SIGINT sent to the chat while it reads: a fresh line, as Ctrl-C
                continue


class PlainInput:
    """Messages from a pipe or a file, a line each (see the module docstring)."""

    def __init__(self, stream: TextIO | None = None, *, prompt: str = PROMPT) -> None:
        self.stream = stream  # None: standard input through input(), a line editor where there is one
        self.prompt = prompt

    def _line(self, prompt: str) -> str | None:
        if self.stream is None:
            try:
                return input(prompt)
            except EOFError:
                if sys.stdin.isatty():
                    print()  # Ctrl-D: the shell's prompt on a line of its own
                return None
        line = self.stream.readline()
        return line.removesuffix("\n") if line else None

    def read(self) -> str | None:
        """The next message; None: the input ended."""
        lines: list[str] = []
        while True:
            line = self._line(self.prompt if not lines else "")
            if line is None:
                return "\n".join(lines) if lines else None
            if not line_continues(line):
                return "\n".join(lines + [line])
            lines.append(line[:-1])


def open_input() -> TerminalInput | PlainInput:
    """The line editor when the chat runs on a terminal, plain lines otherwise."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        return TerminalInput()
    if sys.stdin.isatty():
        import contextlib

        with contextlib.suppress(ImportError):  # a line editor: a terminal alone cuts a pasted line at 4095 bytes
            import readline  # noqa: F401
    return PlainInput()
