"""The conversation: read a message, answer the commands locally, send the rest to the model.

A turn's mistake (a message too long for the context, an error mid-answer) ends that turn, not the
chat, and leaves no trace in the conversation.  Ctrl-C from Enter to the end of the answer stops the
answer (:mod:`edge_spec.chat.interrupt`); the next message is read as usual.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.text import Text

from edge_spec.chat.commands import Command, Unknown, help_lines, parse
from edge_spec.chat.interrupt import CancelOnInterrupt
from edge_spec.errors import EdgeSpecError

Answer = Callable[[list[dict], CancelOnInterrupt], str]


def run_chat(
    engine,
    read: Callable[[], str | None],
    answer: Answer,
    *,
    console: Console,
    system: str | None = None,
    max_tokens: int = 512,
) -> None:
    """Converse until the input ends or /exit: ``read()`` gives the next message (None: the end),
    ``answer(messages, interrupt)`` shows the model's answer to ``messages`` and returns it."""
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    console.print("[dim]edge-spec chat - /help lists the commands, Ctrl-C stops an answer, Ctrl-D leaves[/dim]")
    while True:
        try:
            text = read()
        except KeyboardInterrupt:  # Ctrl-C while plain lines are read: the end, as before there was an editor
            console.print()
            return
        request = parse(text) if text is not None else Command("exit")
        if request is None:
            continue
        if isinstance(request, Unknown):
            console.print(Text(request.line, style="red"), highlight=False)
            continue
        if isinstance(request, Command):
            if request.name == "exit":
                return
            if request.name == "help":
                for line in help_lines():
                    console.print(Text(line), highlight=False)
            elif request.name == "reset":
                history = list(base)
                console.print("[dim]history cleared[/dim]")
            continue
        try:
            history = _turn(engine, history, request.text, answer, console, max_tokens)
        except KeyboardInterrupt:  # Ctrl-C in the instant between Enter and the turn taking it over
            console.print(Text("[cancelled]", style="dim"))


def _turn(engine, history: list[dict], text: str, answer: Answer, console: Console, max_tokens: int) -> list[dict]:
    """One exchange; returns the conversation after it."""
    with CancelOnInterrupt(engine) as interrupt:
        try:
            messages, dropped = engine.fit_messages(
                history + [{"role": "user", "content": text}],
                reserve=min(max_tokens, engine.bundle.target.capacity // 2),
            )
        except EdgeSpecError as exc:
            console.print(f"[red]error:[/red] {exc}", highlight=False)
            return history
        if interrupt.requested:  # before anything was asked of the model
            console.print(Text("[cancelled]", style="dim"))
            return history
        if dropped:
            console.print(f"[dim](dropped the {dropped} oldest messages to fit the context)[/dim]")
        try:
            reply = answer(messages, interrupt)
        except EdgeSpecError as exc:
            console.print(f"[red]error:[/red] {exc}", highlight=False)
            return messages[:-1]
        if interrupt.requested and not reply.strip():  # stopped before it said anything: as if never sent
            return messages[:-1]
        return messages + [{"role": "assistant", "content": reply}]
