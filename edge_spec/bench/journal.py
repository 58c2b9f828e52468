"""A long benchmark's records, kept line by line beside its output, so that a run cut short resumes.

Against every peer mode, the 52 bench prompts take hours on a slow CPU (each prompt is answered by a dozen engine
modes), longer than one sitting at the machine may last.  A run that stops (a closed terminal, a crash, a cloud VM taken
back) must not lose what it measured: each finished unit (a prompt, a session) is appended to
``OUTPUT.partial.jsonl`` as one line and flushed to disk, and the same command run again skips those units.

A run only resumes under the settings it started with, on the same machine: its ratios hold within one run on one
machine, so a journal written under other settings or on another CPU is refused in one line, never mixed in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from hashlib import sha256
from pathlib import Path
from typing import Any

from edge_spec.errors import EdgeSpecError


def journal_path(output: Path) -> Path:
    """Where the journal of a run writing ``output`` (a file or a directory) lives: beside it."""
    return output.with_name(output.name + ".partial.jsonl")


def fingerprint(values: Iterable[Any]) -> str:
    """A short digest of JSON-able values (the prompts' token ids), so that settings name the exact workload."""
    digest = sha256()
    for value in values:
        digest.update(json.dumps(value, sort_keys=True).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def run_settings(options: Mapping[str, Any], ignored: Iterable[str], **workload: Any) -> dict[str, Any]:
    """What a run measures under: its options but the ``ignored`` ones (where results go, what a command does
    besides measuring), its bundle as an absolute path, the ``workload`` (fingerprints of what it answers) and
    the machine."""
    left_out = set(ignored)
    settings = {name: value for name, value in options.items() if name not in left_out}
    if settings.get("bundle"):
        settings["bundle"] = str(Path(settings["bundle"]).resolve())
    settings.update(workload, machine=machine())
    return settings


def machine() -> str:
    """The CPU a measurement ran on and the native kernels it ran (a CPU masked to AVX2 runs other kernels on the
    same CPU); the CPU alone where the native library is not built."""
    from edge_spec.native.build import required_library_path
    from edge_spec.runtime.model.kernel_choice import cpu_description, this_machine

    library = required_library_path()
    return this_machine(library) if library is not None else cpu_description()


class RunJournal:
    """The finished units of one run, by key; see the module's docstring."""

    def __init__(self, output: Path, settings: Mapping[str, Any]) -> None:
        self.path = journal_path(output)
        self.settings = json.loads(json.dumps(dict(settings), sort_keys=True, default=str))
        self.done: dict[str, Any] = {}
        text = self.path.read_text() if self.path.exists() else ""
        if "\n" in text:
            self._read(text)
        else:  # new, or a run stopped while it wrote its first line
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)
            self._append({"settings": self.settings})

    def _read(self, text: str) -> None:
        lines = text.splitlines()
        try:
            theirs = json.loads(lines[0]).get("settings")
        except (ValueError, AttributeError):
            theirs = None
        if theirs != self.settings:
            theirs = theirs if isinstance(theirs, dict) else {}
            differing = sorted(
                key for key in set(self.settings) | set(theirs) if theirs.get(key) != self.settings.get(key)
            )
            raise EdgeSpecError(
                f"{self.path} holds a run under other settings ({', '.join(differing) or 'unreadable'}): "
                "run it again as it started, or remove that file to start over"
            )
        whole = lines
        for number, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
                self.done[str(entry["key"])] = entry["value"]
            except (ValueError, KeyError, TypeError):
                if number < len(lines):
                    raise EdgeSpecError(
                        f"{self.path}: line {number} is damaged: remove the file to start over"
                    ) from None
                whole = lines[:-1]  # the line a stopped run was writing: that unit runs again
        if whole is not lines or not text.endswith("\n"):
            self.path.write_text("\n".join(whole) + "\n")  # the next line starts a line of its own

    def _append(self, entry: Mapping[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def __contains__(self, key: object) -> bool:
        return str(key) in self.done

    def get(self, key: object) -> Any:
        return self.done[str(key)]

    def add(self, key: object, value: Any) -> None:
        """One finished unit, on disk before this returns."""
        self.done[str(key)] = json.loads(json.dumps(value, default=str))
        self._append({"key": str(key), "value": self.done[str(key)]})

    def stopped(self, total: int, units: str) -> str:
        """The line a run stopped by its user ends with."""
        return f"stopped: {len(self.done)} of {total} {units} kept in {self.path}; the same command resumes there"

    def finish(self) -> None:
        """The run's output is written: its journal has served."""
        self.path.unlink(missing_ok=True)
