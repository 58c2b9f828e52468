"""How late the UI thread's event loop runs: a timer due every ``interval_ms`` records how much later than
due each tick came.  A loop blocked by decoding (or by painting too much text) shows up as late ticks."""

from __future__ import annotations

import math
import time

from PySide6.QtCore import QObject, Qt, QTimer


class LatencyProbe(QObject):
    """Start it on the UI thread; :attr:`lateness_ms` holds one entry per tick."""

    def __init__(self, interval_ms: int = 10, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_ms = interval_ms
        self.lateness_ms: list[float] = []
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._tick)
        self._last = 0.0

    def start(self) -> None:
        self.lateness_ms.clear()
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.lateness_ms.append(max(0.0, (now - self._last) * 1000 - self.interval_ms))
        self._last = now

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0 to 100) of the lateness, in milliseconds (nearest rank)."""
        if not self.lateness_ms:
            raise ValueError("no ticks recorded")
        ordered = sorted(self.lateness_ms)
        rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1
        return ordered[rank]
