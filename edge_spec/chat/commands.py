"""What a line typed in the chat means: a command answered locally, or a message for the model.

A command is a line of its own that starts with ``/``; its first word names it.  An unknown name is a
one-line mistake, never a message.  ``//`` sends the rest with one slash removed (a message that starts
with a slash).  Text of several lines is always a message, sent as it is: a pasted snippet that starts
with ``//`` or ``/path`` is not a command.
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> (aliases, what it does): the order of /help
COMMANDS = {
    "help": ((), "list the commands"),
    "reset": ((), "clear the conversation's history"),
    "exit": (("quit",), "leave (Ctrl-D too)"),
}
_NAMES = {alias: name for name, (aliases, _) in COMMANDS.items() for alias in (name, *aliases)}


@dataclass(frozen=True)
class Command:
    name: str  # a key of COMMANDS


@dataclass(frozen=True)
class Message:
    text: str


@dataclass(frozen=True)
class Unknown:
    name: str  # as typed, with its slash

    @property
    def line(self) -> str:
        return f"unknown command {self.name}: /help lists them"


def parse(text: str) -> Command | Message | Unknown | None:
    """What ``text`` (one message as read, possibly of several lines) asks for; None: nothing (blank)."""
    stripped = text.strip()
    if not stripped:
        return None
    if "\n" in stripped or not stripped.startswith("/"):
        return Message(text)
    if stripped.startswith("//"):
        return Message(stripped[1:])
    word = stripped.split()[0]
    name = _NAMES.get(word[1:])
    return Command(name) if name is not None else Unknown(word)


def line_continues(line: str) -> bool:
    """Whether a line read goes on on the next one: it ends with a backslash (which becomes the line break)."""
    return line.endswith("\\")


def help_lines() -> list[str]:
    lines = []
    for name, (aliases, what) in COMMANDS.items():
        names = ", ".join(f"/{n}" for n in (name, *aliases))
        lines.append(f"  {names:<16}{what}")
    lines += [
        "  //text          send /text (a message that starts with a slash)",
        "Enter sends; Alt-Enter (Esc, Enter) or a line ending in \\ starts a new line; a paste is one message.",
        "Ctrl-C stops an answer (or clears the line being typed); Ctrl-D leaves.",
    ]
    return lines
