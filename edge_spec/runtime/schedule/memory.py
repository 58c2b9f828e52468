"""What the schedule carries from one request to the next: acceptance calibration per sampling regime,
and the time a round spends outside the models.

How often a drafter's tokens are accepted is a property of the drafter/target pair (and of greedy
against sampled verification), so a request should not start from a guess: the engine keeps one
:class:`ScheduleMemory` per drafter and head, and stores it beside the device's cost profile, so that
even a one-shot ``edge-spec generate`` plans its first rounds with what earlier runs learned.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration
from edge_spec.runtime.schedule.policy import RoundOverhead


class ScheduleMemory:
    """Calibrations by regime ("greedy" / "coupled" / "sampled"), optionally persisted as one JSON file; the round
    overhead is kept in memory only (a few rounds measure it)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.calibrations: dict[str, AcceptanceCalibration] = {}
        self.overhead = RoundOverhead()
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                self.calibrations = {regime: AcceptanceCalibration.from_dict(d) for regime, d in data.items()}
            except (OSError, ValueError, KeyError, TypeError):
                self.calibrations = {}  # damaged or of an older layout: learn afresh

    def calibration(self, regime: str) -> AcceptanceCalibration:
        """``regime``: ``SamplingParams.regime`` -- greedy, coupled and rejection-sampled verification
        accept at different rates, so each learns its own."""
        return self.calibrations.setdefault(regime, AcceptanceCalibration())

    def save(self) -> None:
        """Write atomically (a reader never sees half a file); a read-only cache is left alone."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({regime: c.to_dict() for regime, c in self.calibrations.items()})
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.path)
        except OSError:
            pass
