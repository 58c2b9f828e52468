"""Where the command line writes: answers and tables on stdout, everything else (progress, errors) on stderr."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


@contextlib.contextmanager
def progress_lines(label: str) -> Iterator[Callable[[str], None]]:
    """A spinner for long exporter work, plus one printed line per step (``progress(message)``)."""
    with console.status(label) as status:

        def progress(message: str) -> None:
            console.print(f"[dim]-[/dim] {message}")
            status.update(message)

        yield progress


def stream(engine, prompt, *, markdown: bool = False, interrupt=None, **kwargs) -> str:
    """Print a streamed answer (raw, or as Markdown on a terminal) and return it; Ctrl-C cancels this
    answer only (``interrupt``: the chat's turn holds Ctrl-C already)."""
    from edge_spec.chat.render import stream_answer

    return stream_answer(engine, prompt, out=out, console=console, markdown=markdown, interrupt=interrupt, **kwargs)
