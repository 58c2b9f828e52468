"""The export's steps: each timed, the memory each needs checked before it starts, and running out of
memory said in one line.

Why: an export that runs out of memory is killed by the operating system, which prints ``Killed`` and
nothing else; the process cannot catch that.  So before a step that loads or builds a model, the memory
it needs (an estimate from the source's size, :func:`memory_needed`) is compared with what the system
has available, and a step that cannot fit is refused in one line that says what was being built, how
much it needs and what to close.  A ``MemoryError`` inside a step (an allocation Python itself sees
fail) becomes the same line.  At the end, one line says where the time went and the peak memory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle import activity

GB = 1e9
#: memory an export holds whatever the models (Python, torch, transformers, ONNX Runtime, a tokenizer)
BASE_BYTES = int(0.6 * GB)
#: an export's peak above that, per byte of the source's weights: a GGUF file or a directory's
#: safetensors files (read a tensor at a time), or the float32 model transformers loads whole (a
#: ``pytorch_model.bin`` checkpoint)
PER_BYTE = {"gguf": 2.0, "safetensors": 1.0, "float": 3.0}


def available_memory() -> int | None:
    """Bytes the system can give this process without swapping it out (Linux: MemAvailable plus free
    swap, which a slow export may use), or None where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available + psutil.swap_memory().free)
    except Exception:  # psutil missing, or no reading on this system
        return None


def peak_memory() -> int | None:
    """The most memory this process has held so far (resident set), or None where it cannot be read.
    Linux: ``VmHWM``, the peak of this program (``ru_maxrss`` of a process started by fork and exec, as
    the command starts the export's, begins at the size of the process it was forked from)."""
    from edge_spec.export.bundle.watchdog import peak_memory_of

    if sys.platform.startswith("linux") and (peak := peak_memory_of(os.getpid())) is not None:
        return peak
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def source_bytes(source: str) -> tuple[int, str] | None:
    """(bytes, kind) of a local source's weights (a key of :data:`PER_BYTE`): a GGUF file's size, a
    Hugging Face directory's safetensors files, or its ``*.bin`` files as float32 (twice a 16-bit
    checkpoint); None for a source that is not (yet) on disk."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.stat().st_size, "gguf"
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ggufs[0].stat().st_size, "gguf"
        for pattern, kind, widen in (("*.safetensors", "safetensors", 1), ("*.bin", "float", 2)):
            files = list(path.glob(pattern))
            if files:
                return sum(f.stat().st_size for f in files) * widen, kind
    return None


def _registry_bytes(source: str) -> tuple[int, str] | None:
    """A registry model's GGUF size, as the registry records it (it may not be downloaded yet)."""
    try:
        from edge_spec import fetch

        size = fetch.load_registry()["models"][source]["gguf"]["size"]
    except Exception:  # not a registry name, or an entry without a GGUF file
        return None
    return int(size), "gguf"


def memory_needed(source: str) -> int | None:
    """About how much memory exporting ``source`` needs at its peak (see the module docstring); None
    where its size is not known before loading it (a hub id)."""
    located = source_bytes(source) or _registry_bytes(source)
    if located is None:
        return None
    size, kind = located
    return BASE_BYTES + int(size * PER_BYTE[kind])


def _gb(size: float) -> str:
    return f"{size / GB:.1f} GB"


class Stages:
    """The steps of one export, timed; ``progress`` gets each step's line and the closing summary."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self._progress = progress
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    @contextlib.contextmanager
    def step(self, name: str, line: str | None = None, *, needs: int | None = None) -> Iterator[None]:
        """Run one step called ``name`` (in the summary and in an out-of-memory line), said as ``line``;
        refused first when ``needs`` bytes are more than the system has available."""
        available = available_memory()
        if needs is not None and available is not None and needs > available:
            raise EdgeSpecError(
                f"not enough memory for {name}: it needs about {_gb(needs)} and {_gb(available)} is available; "
                "close other programs (browsers, other models, IDEs) or export on a machine with more memory "
                "(nothing was written)"
            )
        activity.step(name)
        if line:
            self._say(line)
        started = time.perf_counter()
        try:
            yield
        except MemoryError:
            peak = peak_memory()
            held = f" after holding {_gb(peak)}" if peak else ""
            need = f" (it needs about {_gb(needs)})" if needs else ""
            raise EdgeSpecError(
                f"ran out of memory during {name}{held}{need}: close other programs (browsers, other models, "
                "IDEs) or export on a machine with more memory (nothing was written)"
            ) from None
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def summary(self) -> str:
        """One line: the whole export's time, each step's, and the peak memory."""
        total = time.perf_counter() - self._started
        steps = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.seconds.items())
        peak = peak_memory()
        return f"export took {total:.0f} s ({steps})" + (f"; peak memory {_gb(peak)}" if peak else "")

    def say_summary(self) -> None:
        self._say(self.summary())
