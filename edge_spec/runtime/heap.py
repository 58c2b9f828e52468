"""Give the memory of a closed engine back to the operating system.

Dropping the last reference to an ONNX Runtime session frees its weights and buffers to the C allocator,
but glibc keeps freed heap memory mapped for reuse: the process's resident size stays where it was
(a 1.5B bundle's load leaves hundreds of megabytes behind), though the next load reuses the memory.  An
application that closes its model to make room for something else wants that memory back, so
:func:`release` collects what only a reference cycle still holds and asks glibc to return its free pages
(``malloc_trim``).  Elsewhere (macOS, Windows, musl), only the collection runs: those allocators return
large blocks themselves.

A server frees megabytes at a time too (a large request body, its decoded text, a long tokenization),
in whichever of glibc's per-thread arenas the worker thread used, and glibc keeps those pages as well:
the resident size then climbs with every such request although nothing is kept.  :func:`trim` returns
them without a collection, at most once per interval, so that a stream of large requests costs little.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys
import threading
import time


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # no glibc (musl has no malloc_trim)
        return None


def release() -> None:
    """Free what reference cycles hold, then return the allocator's free pages to the system."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_trimmed = {"at": float("-inf")}
_trim_lock = threading.Lock()


def trim(min_interval: float = 0.0) -> bool:
    """Return the allocator's free pages to the system, unless that was done less than ``min_interval``
    seconds ago (then, or where there is no ``malloc_trim``, False).  Blocking for milliseconds, without
    the GIL (ctypes lets it go): call it from a worker thread."""
    trim_call = _malloc_trim()
    if trim_call is None:
        return False
    with _trim_lock:
        now = time.monotonic()
        if now - _trimmed["at"] < min_interval:
            return False
        _trimmed["at"] = now
    trim_call(0)
    return True
