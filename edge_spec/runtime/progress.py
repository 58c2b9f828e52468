"""A bundle load's progress, told to a callback, and the load's cancellation.

A desktop application shows a bar while a bundle loads and lets the user give up, as llama.cpp's
``progress_callback`` does (return False to abort).  A load goes through up to three stages, in this order:

``verifying``
    hashing files against the manifest's SHA-256: every file first with ``verify``, else, after the
    models are read, what is left of the files changed since they were last found whole (hashed in the
    background while the models are read, so often nothing);
``reading``
    the tokenizer, the target and, in the speculative modes, the drafter;
``measuring``
    this machine's cost profile, read from the cache or, on a first load, measured (a few seconds); and on a
    bundle's first load on a machine other than its export's, in every mode, the native op's kernels timed
    (about 5 s, ``runtime.model.kernel_choice``).

Each stage reports 0.0 first and 1.0 last; ``fraction`` in between counts bytes (files hashed, model
files read).  A cancel is seen at the next report: between hashed blocks, between the models, and
before and after the measurement, whose passes run to their end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_spec.errors import EdgeSpecError

if TYPE_CHECKING:
    from edge_spec.integrity import WeightCheck

STAGES = ("verifying", "reading", "measuring")
REPORT_STEP = 0.01  # a stage's progress is reported when it moved this much (a block is 4 MiB of hashing)
POLL_SECONDS = 0.05  # how often a wait for the background hashing reports, and looks for a cancel


@dataclass(frozen=True)
class LoadProgress:
    stage: str  # "verifying", "reading" or "measuring"
    fraction: float  # of this stage done, 0.0 to 1.0


ProgressCallback = Callable[[LoadProgress], "bool | None"]


class LoadCancelled(EdgeSpecError):
    """A load stopped by its progress callback (which returned False) or its cancel event; what it had
    loaded is freed."""


class LoadTracker:
    """One load's progress reports and cancel checks.  Without a callback or a cancel event it reports
    nothing and never cancels (``active`` is False), and the load runs as it always has."""

    def __init__(self, on_progress: ProgressCallback | None, cancel: threading.Event | None, what: str) -> None:
        self.on_progress = on_progress
        self.cancel = cancel
        self.what = what  # the bundle, as the cancel error names it
        self._last: tuple[str, float] | None = None

    @property
    def active(self) -> bool:
        return self.on_progress is not None or self.cancel is not None

    def check(self) -> None:
        """Raise :class:`LoadCancelled` once the load was cancelled."""
        if self.cancel is not None and self.cancel.is_set():
            raise LoadCancelled(f"loading {self.what} was cancelled")

    def report(self, stage: str, fraction: float) -> None:
        """Tell the callback (a fraction moved by less than ``REPORT_STEP`` since the last report is not
        told, except the stage's first and last), then check for a cancel."""
        fraction = min(max(fraction, 0.0), 1.0)
        last = self._last
        moved = last is None or last[0] != stage or fraction - last[1] >= REPORT_STEP or fraction == 1.0 != last[1]
        if self.on_progress is not None and moved:
            self._last = (stage, fraction)
            if self.on_progress(LoadProgress(stage, fraction)) is False:
                if self.cancel is None:
                    self.cancel = threading.Event()
                self.cancel.set()
        self.check()

    def counter(self, stage: str, total: int) -> Callable[[int], None]:
        """An ``on_block(size)`` for hashing ``total`` bytes: reports ``stage`` as the bytes add up."""
        done = 0

        def on_block(size: int) -> None:
            nonlocal done
            done += size
            self.report(stage, done / total if total else 1.0)

        return on_block

    def wait_for(self, check: WeightCheck | None) -> None:
        """The ``verifying`` stage of the background hashing: wait for it, reporting its bytes, and stop it
        when the load is cancelled."""
        self.report("verifying", 0.0)
        if check is not None:
            while not check.wait(POLL_SECONDS):
                self.report("verifying", check.hashed_bytes / check.total_bytes if check.total_bytes else 0.0)
        self.report("verifying", 1.0)
