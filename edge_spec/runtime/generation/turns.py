"""Who holds the engine: one generation at a time, taken over by a newer one in the same thread, and
cancelled from any thread.

A generation holds the engine from its first chunk until its generator is exhausted or closed; a caller
in another thread waits for it (or, with ``wait=False``, gets :class:`EngineBusy`).  A new generation
in the same thread takes over: the one it replaced raises :class:`GenerationSuperseded` when resumed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.model.decoder import Decoder


class EngineBusy(EdgeSpecError):
    """``generate(..., wait=False)`` while another thread's generation is in progress."""


class GenerationSuperseded(EdgeSpecError):
    """A generator resumed after the same thread started a newer generation on the engine."""


class EngineClosed(EdgeSpecError):
    """A generation asked of an engine after ``Engine.close``."""


class Turns:
    """The engine's lock (held by one thread, possibly several times), its active generation and the
    cancel flag that generation watches."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self._turn = threading.Condition()
        self._owner: int | None = None
        self._holds = 0
        self.generation = 0  # the active generation; an older generator raises when resumed
        self.tokens: Iterator[int] | None = None  # the active generation's token loop
        self.interruptible: list[Decoder] = []  # the decoders of the active generation's token loop

    def acquire(self, wait: bool) -> None:
        me = threading.get_ident()
        with self._turn:
            if self._owner not in (None, me):
                if not wait:
                    raise EngineBusy("engine busy: another generation is in progress")
                self._turn.wait_for(lambda: self._owner is None)
            self._owner = me
            self._holds += 1

    def release(self) -> None:
        with self._turn:
            self._holds -= 1
            if self._holds == 0:
                self._owner = None
                self._turn.notify_all()

    @contextlib.contextmanager
    def held(self, wait: bool = True) -> Iterator[None]:
        self.acquire(wait)
        try:
            yield
        finally:
            self.release()

    def take_over(self) -> int:
        """Start a new generation (the engine is held): the one it replaces in this thread stops here,
        its token loop closed (an SSD loop's pending target pass finishes first)."""
        self.close_tokens()
        self.generation += 1
        return self.generation

    def close_tokens(self) -> None:
        if self.tokens is not None:
            self.tokens.close()
            self.tokens = None

    def check_active(self, generation: int) -> None:
        if generation != self.generation:
            raise GenerationSuperseded(
                "this generation was superseded by a newer one on the same engine "
                "(finish or close a generator before starting the next)"
            )

    def cancel(self) -> None:
        """Stop the active generation: the flag first, then cut the pass under way (a pass starting
        now sees the flag through its decoder's ``stop_requested``)."""
        self.cancelled.set()
        for decoder in self.interruptible:
            decoder.interrupt()
