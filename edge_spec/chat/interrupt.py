"""Ctrl-C during an answer stops that answer, whenever it is pressed after Enter.

:class:`CancelOnInterrupt` holds SIGINT for one turn: from the moment the message is read, through the
fitting of the conversation to the context, the reading of the prompt and the answer, until the
footer.  Its handler only records the request and calls ``engine.cancel()``.  An engine clears earlier
cancels when a generation starts, so a Ctrl-C pressed between Enter and that start would be lost;
:meth:`CancelOnInterrupt.renew` (called by the renderer at each prefill report and each chunk) repeats
a recorded request, and the engine stops at its next check.  Outside a turn Ctrl-C is the usual
KeyboardInterrupt.

For the same span the terminal's echo is off (:func:`echo_off`): a terminal echoes ``^C`` (and any key
typed) where the cursor is, which is the end of the answer's live lines; at the end of a line drawn to the
full width the echo starts a new line, the redraw lands one line lower, and the partial answer showed twice.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def echo_off(stream=None) -> Iterator[None]:
    """Within the block, the terminal on ``stream`` (default: standard input) echoes nothing; keys typed
    meanwhile are still read later.  Nothing happens where ``stream`` is no terminal."""
    try:
        import termios
    except ImportError:  # Windows: its console echoes no ^C
        yield
        return
    try:
        fd = (stream or sys.stdin).fileno()
        before = termios.tcgetattr(fd)
        quiet = list(before)
        quiet[3] &= ~termios.ECHO  # the local modes
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except (AttributeError, ValueError, OSError, termios.error):  # no terminal, a closed or replaced stdin
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(fd, termios.TCSANOW, before)


class CancelOnInterrupt:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.requested = False
        self._previous = None
        self._installed = False
        self._echo = contextlib.ExitStack()

    def _on_sigint(self, signum, frame) -> None:
        self.requested = True
        self.engine.cancel()

    def renew(self) -> None:
        """Repeat a Ctrl-C pressed before the generation started (it cleared that cancel)."""
        if self.requested:
            self.engine.cancel()

    def __enter__(self) -> CancelOnInterrupt:
        # signal handlers belong to the main thread; elsewhere (a server, a test runner's worker) Ctrl-C
        # is not ours to take, and engine.cancel() stays the way to stop
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
            self._echo.enter_context(echo_off())
        return self

    def __exit__(self, *exc) -> None:
        self._echo.close()
        if self._installed:
            # None: a handler set outside Python; the usual KeyboardInterrupt then
            signal.signal(signal.SIGINT, signal.default_int_handler if self._previous is None else self._previous)
            self._installed = False
