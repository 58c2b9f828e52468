"""Keep freed large blocks in the process heap, so that every round does not fault in fresh pages.

Each decoding round makes arrays the size of a vocabulary row: the logits ORT hands back (600 KB a row on
a 150k vocabulary), their probabilities (1.2 MB in float64), the race's noise.  glibc serves a block
that large from a fresh ``mmap`` and unmaps it on ``free``, or, once a free has raised its threshold,
from the top of the heap, which it trims back to the kernel as soon as the top holds twice that.  Either
way the next round's block is fresh memory: hundreds of page faults (each a trap into the kernel and a
zeroed page, twice the price inside a virtual machine) for a few microseconds of arithmetic.  Turning
one float32 row into sampling probabilities cost five times more in page faults than in work.

So the first :class:`~edge_spec.runtime.model.decoder.Decoder` of a process sets glibc's two thresholds
(``mallopt``): blocks under :data:`MMAP_THRESHOLD` come from the heap, and the heap gives back its top
only past :data:`TRIM_THRESHOLD`, so a round reuses the pages the last one freed.  What stays mapped is
at most what a round has in use at once plus the trim threshold; the model weights and the KV cache are
allocated once either way.

Elsewhere (macOS, Windows, musl), where ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is set
(the owner chose), or with ``EDGE_SPEC_KEEP_HEAP=0``, nothing changes.  What it is worth is measured in
the README (with ``benchmarks/memory_ab.py --switch heap``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its sliding threshold on 64-bit systems
TRIM_THRESHOLD = 128 << 20
M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
ENV_SWITCH = "EDGE_SPEC_KEEP_HEAP"  # "0": glibc's defaults
OWNER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_DONE: bool | None = None  # None: not tried yet; else whether the thresholds were set


def keep_heap() -> bool:
    """Set the thresholds once per process; whether they are set (False where they are left alone)."""
    global _DONE
    if _DONE is None:
        _DONE = _enabled() and _set_thresholds()
    return _DONE


def _enabled() -> bool:
    return (sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1") != "0"
            and not any(name in os.environ for name in OWNER_SETTINGS))


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl has no mallopt thresholds
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mmap first: a trim threshold alone would still leave every large block to its own mmap
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
