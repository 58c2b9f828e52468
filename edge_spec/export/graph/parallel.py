"""Work on independent pieces of a weight on every core.

Why: reading a weight band (a GGUF band is dequantized by numpy) and quantizing it are numpy work that
releases the GIL, and an export did it one band after another on one core.  The bands of a matrix are
independent (each row is rounded on its own) and each worker writes its own rows of the result, so the
output is the same bytes whatever the number of workers.  The workers share the memory one thread's band
took: with :data:`WORKERS` threads a band is that many times smaller
(:data:`~edge_spec.export.graph.quantize.QUANTIZE_BAND_BYTES`), so an export's peak does not grow with the cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: threads that work on the pieces of one weight (1: in the calling thread, one piece after another)
WORKERS = max(1, os.cpu_count() or 1)

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != WORKERS:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(WORKERS, thread_name_prefix="edge-spec-export"), WORKERS
        return _pool


def each(function: Callable[[T], None], items: Iterable[T]) -> None:
    """``function(item)`` for every item, on :data:`WORKERS` threads; the first exception (a MemoryError,
    a read error) is raised once the pieces already running have finished, and the pieces not yet
    started are dropped (so is everything on Ctrl-C)."""
    items = list(items)
    if WORKERS == 1 or len(items) < 2 or threading.current_thread().name.startswith("edge-spec-export"):
        for item in items:
            function(item)
        return
    futures: list[Future] = [_executor().submit(function, item) for item in items]
    try:
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # wait for those that run: they write into the caller's arrays
        raise
    finally:
        _give_back()


def _give_back() -> None:
    """Return the memory the workers freed to the system (glibc keeps a freed block in the arena of the
    thread that held it, one arena a thread, for that thread to use again)."""
    global _trim
    if _trim is None:
        try:
            import ctypes

            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)


_trim = None
