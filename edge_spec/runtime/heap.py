"""Give the memory of a closed engine back to the operating system.

Dropping the last reference to an ONNX Runtime session frees its weights and buffers to the C allocator,
but glibc keeps freed heap memory mapped for reuse: the process's resident size stays where it was
(a 1.5B bundle's load leaves hundreds of megabytes behind), though the next load reuses the memory.  An
application that closes its model to make room for something else wants that memory back, so
:func:`release` collects what only a reference cycle still holds and asks glibc to return its free pages
(``malloc_trim``).  Elsewhere (macOS, Windows, musl), only the collection runs: those allocators return
large blocks themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys


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
