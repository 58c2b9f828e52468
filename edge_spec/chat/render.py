"""A streamed answer on the screen: Markdown with highlighted code blocks on a terminal, re-rendered
as chunks arrive; the text as it comes anywhere else (a pipe, a file, ``--plain``).

The Markdown is rendered whole at each refresh (at most every ``min_interval`` seconds, less often when
rendering gets slow), but only its last lines stay live (redrawn in place): the lines above them are
printed once, for good, as the answer grows.  A live area taller than the terminal cannot be redrawn
(its top has scrolled away), which would repeat the answer on the screen.

Model text is text: on a terminal its control characters are shown as the symbols Unicode has for them
(ESC as ␛), so that an escape sequence in an answer (a window title, colours, a clipboard write) is never
run by the terminal.  The answer itself is kept as it came, and a pipe gets it unchanged.
"""

from __future__ import annotations

import contextlib
import time

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.text import Text

from edge_spec.chat.interrupt import CancelOnInterrupt

# C0 controls but tab and newline, DEL and C1 controls: their Unicode pictures (a carriage return goes)
_VISIBLE = {code: chr(0x2400 + code) for code in range(32) if code not in (9, 10, 13)}
_VISIBLE |= {13: None, 0x7F: "\u2421"} | {code: "\ufffd" for code in range(0x80, 0xA0)}


def visible(text: str) -> str:
    """``text`` with every character a terminal would act on instead of show replaced by a picture of it."""
    return text.translate(_VISIBLE)


class _Lines:
    """Rendered lines printed as they are."""

    def __init__(self, lines: list[list[Segment]]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for index, line in enumerate(self.lines):
            if index:
                yield Segment.line()
            yield from line


class MarkdownStream:
    """Shows an answer chunk by chunk (see the module docstring); a context manager that finishes it."""

    def __init__(
        self, console: Console, *, markdown: bool = True, min_interval: float = 0.1, code_theme: str = "monokai"
    ) -> None:
        self.console = console
        self.markdown = markdown and console.is_terminal and not console.is_dumb_terminal
        self.min_interval = min_interval
        self.code_theme = code_theme
        self.text = ""
        self._live: Live | None = None
        self._shown = 0  # rendered lines printed for good above the live area
        self._interval = min_interval
        self._rendered_at = 0.0

    def __enter__(self) -> MarkdownStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, chunk: str) -> None:
        self.text += chunk
        if not self.markdown:
            shown = visible(chunk) if self.console.is_terminal else chunk
            self.console.print(shown, end="", markup=False, highlight=False)  # model text is never markup
            self.console.file.flush()
            return
        if self._live is None:
            self._live = Live(
                Text(""),
                console=self.console,
                auto_refresh=False,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
                vertical_overflow="crop",
            )
            self._live.start()
        if time.monotonic() - self._rendered_at >= self._interval:
            self._render()

    def close(self) -> None:
        if not self.markdown:
            self.console.print()
            return
        if self._live is not None:
            self._live.stop()  # transient: the live lines go, and are printed for good below
            self._live = None
            self.console.print(_Lines(self._lines()[self._shown :]))

    def _lines(self) -> list[list[Segment]]:
        lines = self.console.render_lines(
            Markdown(visible(self.text), code_theme=self.code_theme),
            self.console.options.update_width(self.console.width),
            pad=False,
        )
        while lines and not "".join(segment.text for segment in lines[-1]).strip():
            lines.pop()  # the blank lines a paragraph or a block ends with
        return lines

    def _render(self) -> None:
        started = time.monotonic()
        lines = self._lines()
        stable = max(self._shown, len(lines) - max(1, min(self.console.height - 2, 12)))
        if stable > self._shown:
            self._live.console.print(_Lines(lines[self._shown : stable]))
            self._shown = stable
        self._live.update(_Lines(lines[self._shown :]), refresh=True)
        self._rendered_at = time.monotonic()
        # rendering takes a fifth of the time at most: a long answer is re-rendered less often
        self._interval = max(self.min_interval, 4 * (self._rendered_at - started))


class PromptSpinner:
    """A transient spinner on ``console`` from Enter to the first chunk: "reading the prompt", with the
    fraction read when the prompt takes several passes."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._status = None

    def start(self) -> None:
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self._status = self.console.status("[dim]reading the prompt[/dim]")
            self._status.start()

    def update(self, fraction: float) -> None:
        if self._status is not None:
            self._status.update(f"[dim]reading the prompt {fraction:.0%}[/dim]")

    def say(self, what: str) -> None:
        """Show ``what`` instead while it lasts (a first run's device check; "" when done)."""
        if self._status is not None:
            self._status.update(f"[dim]{what or 'reading the prompt'}[/dim]")

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def footer(stats) -> str:
    """The one-line summary of an answer: tokens, speed, prefill time, τ, seed, why it stopped.  The speed
    counts the tokens after the first (the prompt's pass gives that one): under two, it is ``-``."""
    speed = f"{stats.tokens_per_second:.1f}" if stats.new_tokens >= 2 else "-"
    line = f"[{stats.new_tokens} tokens, {speed} tok/s, prefill {stats.prefill_seconds:.2f} s"
    if stats.spec is not None and stats.spec.tau:
        line += f", τ {stats.spec.tau:.2f}"
    if stats.coupled_seed is not None:
        line += f", seed {stats.coupled_seed}"  # a coupled answer is remade by its seed
    return f"{line}, {stats.stop_reason}]"


def stream_answer(
    engine,
    prompt,
    *,
    out: Console,
    console: Console,
    markdown: bool = False,
    interrupt: CancelOnInterrupt | None = None,
    **kwargs,
) -> str:
    """Show ``engine``'s answer to ``prompt`` as it streams (on ``out``; the spinner and the footer on
    ``console``) and return it.  Ctrl-C stops this answer only: ``interrupt`` holds SIGINT for the
    caller's turn, else it is held here from before the generation starts to the footer."""
    from edge_spec.runtime.schedule.cost_profile import on_measure  # with the runtime, not with the chat

    spinner = PromptSpinner(console)
    with contextlib.ExitStack() as stack:
        if interrupt is None:
            interrupt = stack.enter_context(CancelOnInterrupt(engine))

        def on_prefill(fraction: float) -> None:
            interrupt.renew()
            spinner.update(fraction)

        shown = stack.enter_context(MarkdownStream(out, markdown=markdown))
        stack.callback(spinner.stop)  # stopped before the answer is finished on the screen
        spinner.start()
        stack.enter_context(on_measure(spinner.say))  # a first answer may check the machine first
        for chunk in engine.generate(prompt, on_prefill=on_prefill, **kwargs):
            spinner.stop()
            interrupt.renew()
            shown.add(chunk)
    console.print(Text(footer(engine.last_stats), style="dim"), highlight=False)
    return shown.text
