"""The engine's side of the window: a QObject living in its own QThread that loads a bundle and decodes.

The window talks to it with queued signals (its slots run on the worker thread, one at a time), except for
:meth:`EngineWorker.stop` and :meth:`EngineWorker.take_pieces`, which the window calls directly: they only
touch thread-safe state.  Streamed text does not travel one signal per token: the worker appends the
``[text, source]`` pieces to a buffer and signals only when the buffer was empty, and the window takes
everything buffered at once, so a fast decoder cannot flood the UI thread's event queue.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine, GenerationStats
from edge_spec.runtime.progress import LoadCancelled, LoadProgress

Piece = list  # [text, source]


def default_threads() -> int:
    """ONNX Runtime threads for a desktop app: every core but one, which stays the UI thread's.  Decoding
    on all of them makes the event loop wait for a core while the intra-op threads run (and spin)."""
    return max(1, (os.cpu_count() or 1) - 1)


class EngineWorker(QObject):
    loaded = Signal(str)  # the bundle's path, once it is ready
    load_failed = Signal(str)  # one line: why the bundle could not be loaded ("" when it was cancelled)
    load_progress = Signal(str, float)  # the load's stage ("verifying", "reading", "measuring") and its fraction
    progress = Signal(float)  # reading a long prompt: the fraction read
    pieces_ready = Signal()  # streamed pieces wait in the buffer: take_pieces()
    finished = Signal(object)  # the answer ended (GenerationStats; stop_reason "cancelled" after stop())
    failed = Signal(str)  # one line: why the answer could not be given

    def __init__(self, load_options: dict | None = None) -> None:
        super().__init__()
        # Engine.from_bundle keywords: mode, threads (default: default_threads()), ...
        self.load_options = {"threads": default_threads(), **(load_options or {})}
        self.engine: Engine | None = None
        self._stop = threading.Event()
        self._cancel_load = threading.Event()
        self._lock = threading.Lock()
        self._pieces: list[Piece] = []

    # called from the window's thread
    def arm(self) -> None:
        """Forget an earlier stop before a new answer is asked for (the previous one has ended)."""
        self._stop.clear()

    def stop(self) -> None:
        """Stop the answer in progress, or the one about to start, at the engine's next check."""
        self._stop.set()
        engine = self.engine
        if engine is not None:
            engine.cancel()

    def cancel_load(self) -> None:
        """Give up the load in progress (at its next progress report), having freed what it read."""
        self._cancel_load.set()

    def take_pieces(self) -> list[Piece]:
        """Everything streamed since the last call, in order."""
        with self._lock:
            pieces, self._pieces = self._pieces, []
        return pieces

    def close(self) -> None:
        """Release the engine (call once the worker thread has ended)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # slots, run on the worker thread
    @Slot(str)
    def load(self, path: str) -> None:
        """Load the bundle at ``path`` in place of the current one (a load asked for while another ran
        cancelled that one: this one starts afresh)."""
        self.close()
        self._cancel_load.clear()

        def on_progress(progress: LoadProgress) -> None:
            self.load_progress.emit(progress.stage, progress.fraction)

        try:
            engine = Engine.from_bundle(
                Path(path), on_progress=on_progress, cancel=self._cancel_load, **self.load_options
            )
        except LoadCancelled:
            self.load_failed.emit("")
            return
        except (EdgeSpecError, OSError) as error:
            self.load_failed.emit(str(error).splitlines()[0] if str(error) else type(error).__name__)
            return
        self.engine = engine
        self.loaded.emit(path)

    @Slot(object, object)
    def generate(self, messages: list[dict], settings: dict) -> None:
        """Answer the chat ``messages`` with ``generate``'s keyword ``settings`` (max_new_tokens, ...)."""
        engine = self.engine
        if engine is None:
            self.failed.emit("no bundle is loaded")
            return
        if self._stop.is_set():  # stopped before it began
            self.finished.emit(GenerationStats(stop_reason="cancelled"))
            return

        def on_prefill(fraction: float) -> None:
            self._renew()
            self.progress.emit(fraction)

        try:
            for _ in engine.generate(messages, on_sources=self._publish, on_prefill=on_prefill, **settings):
                self._renew()
        except (EdgeSpecError, OSError) as error:
            self.failed.emit(str(error).splitlines()[0])
            return
        self.finished.emit(engine.last_stats)

    def _renew(self) -> None:
        """Repeat a stop pressed before the engine started this answer (it clears earlier cancels)."""
        if self._stop.is_set():
            self.engine.cancel()

    def _publish(self, pieces: list[Piece]) -> None:
        self._renew()
        pieces = [piece for piece in pieces if piece[0]]
        if not pieces:
            return
        with self._lock:
            notify = not self._pieces
            self._pieces.extend(pieces)
        if notify:
            self.pieces_ready.emit()
