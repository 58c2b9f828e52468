"""Following an answer's model passes: prefill progress as one fraction, and stopping them on cancel.

Each decoder a loop uses gets a ``prefill_listener`` (the target's progress, and a stop between prefill passes) and
a ``stop_requested`` check (a pass about to start when the cancel came is refused); the engine's cancel
then interrupts the pass under way (:meth:`Decoder.interrupt`).  The answer ends as a cancel between
passes ends it, having given only verified tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from edge_spec.runtime.model.decoder import Decoder, PassInterrupted


class PrefillCancelled(Exception):
    """Raised between prefill passes once the answer was cancelled (caught by the engine)."""


def watch(
    decoders: list[Decoder],
    cancelled: Callable[[], bool],
    on_prefill: Callable[[float], None] | None,
) -> None:
    """Hook ``decoders`` (the target first): stop between their prefill passes once ``cancelled()`` and
    refuse their passes then; report the target's prefill as a fraction.  The drafters read a long prompt
    after the first token is out, and a short one in a blink (:meth:`Request.start
    <edge_spec.runtime.loops.request.Request.start>`), so the prompt reading worth showing is the target's."""
    for index, decoder in enumerate(decoders):
        report = on_prefill if index == 0 else None

        def listener(done: int, prompt: int, report: Callable[[float], None] | None = report) -> None:
            if cancelled():
                raise PrefillCancelled
            if report is not None:
                report(done / prompt)

        decoder.prefill_listener = listener
        decoder.stop_requested = cancelled


def unwatch(decoders: list[Decoder]) -> None:
    for decoder in decoders:
        decoder.prefill_listener = decoder.stop_requested = None


def until_interrupted(tokens: Iterator[int], cancelled: Callable[[], bool]) -> Iterator[int]:
    """The token loop's tokens until a pass of it is cut or refused by a cancel: the answer then ends as a
    cancel between passes ends it (the tokens given were verified; the text held back is flushed)."""
    try:
        yield from tokens
    except PassInterrupted:
        if not cancelled():  # only a cancel cuts passes
            raise
