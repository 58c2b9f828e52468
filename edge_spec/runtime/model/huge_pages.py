"""Model weights and KV caches on 2 MiB pages.

A decode step streams every weight once, about a gigabyte for a 1.5B int4 target.  On 4 KiB pages that
is a quarter of a million pages a step: the CPU's stream prefetchers stop at every page boundary and the
TLB misses on every page (twice over inside a virtual machine).  Linux backs memory with 2 MiB pages
("transparent huge pages") where a process asks for them, which on most distributions is only where it
calls ``madvise(MADV_HUGEPAGE)``; ONNX Runtime does not, so its weights sit on small pages.

So a :class:`Decoder` notes the process's anonymous mappings before it opens its session and allocates
its KV cache, and afterwards asks the kernel to move what appeared in between onto huge pages: first
``MADV_HUGEPAGE`` (khugepaged then does it in the background, over minutes, on any kernel with THP),
then ``MADV_COLLAPSE`` (Linux 6.1+: done now, a copy of the pages).  The collapse runs in a thread of
its own, so that loading is not slower; :meth:`HugePagePromotion.wait` joins it, which benchmarks do
before they time anything.  The contents never change, only the pages under them.

Elsewhere (macOS, Windows, no ``/proc``), where the system's THP mode is "never", or with
``EDGE_SPEC_HUGE_PAGES=0``, nothing happens.  What it is worth is measured in the README (*The schedule
follows the machine*, with ``benchmarks/huge_pages_ab.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from dataclasses import dataclass

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
ENV_SWITCH = "EDGE_SPEC_HUGE_PAGES"  # "0": leave the pages as the allocator made them

Region = tuple[int, int]  # [start, end) addresses
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The system's transparent huge page mode: "always", "madvise", "never", or "absent"."""
    try:
        with open(THP_SETTING) as handle:
            text = handle.read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "absent"


def enabled() -> bool:
    """Whether this process may promote: Linux with ``/proc``, huge pages not turned off by the system's
    owner (mode "never": ``MADV_COLLAPSE`` would ignore that), and not switched off for edge-spec."""
    return (
        sys.platform.startswith("linux")
        and os.path.exists("/proc/self/maps")
        and thp_mode() in ("always", "madvise")
        and os.environ.get(ENV_SWITCH, "1") != "0"
    )


def anonymous_regions() -> list[Region]:
    """The process's private writable memory backed by no file: ``mmap`` allocations and the ``brk``
    heap, where the allocator puts large blocks too once frees have raised its mmap threshold."""
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            anonymous = len(fields) == 5 or (len(fields) == 6 and fields[5] == "[heap]")
            if anonymous and fields[1] == "rw-p" and fields[4] == "0":
                start, end = fields[0].split("-")
                regions.append((int(start, 16), int(end, 16)))
    return sorted(regions)


def added(now: list[Region], before: list[Region]) -> list[Region]:
    """The address ranges in ``now`` that no region of ``before`` covered (a grown heap or a mapping
    merged with its neighbour counts only for its new part)."""
    ranges = []
    for start, end in now:
        cursor = start
        for old_start, old_end in before:
            if old_end <= cursor or old_start >= end:
                continue
            if old_start > cursor:
                ranges.append((cursor, old_start))
            cursor = max(cursor, old_end)
        if cursor < end:
            ranges.append((cursor, end))
    return ranges


def huge_aligned(regions: list[Region]) -> list[Region]:
    """The whole 2 MiB pages inside each region (only those can be huge pages)."""
    aligned = []
    for start, end in sorted(regions):
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last > first:
            aligned.append((first, last))
    return aligned


@dataclass
class Promotion:
    """Bytes asked to be on huge pages, and bytes the kernel moved at once (MADV_COLLAPSE)."""

    advised: int = 0
    collapsed: int = 0


def promote(regions: list[Region]) -> Promotion:
    """Ask for huge pages under ``regions`` (2 MiB aligned); a refusal (old kernel, memory that cannot
    be huge) leaves that region as it was."""
    madvise = _madvise()
    done = Promotion()
    if madvise is None:
        return done
    for start, end in regions:
        if madvise(start, end - start, MADV_HUGEPAGE) == 0:
            done.advised += end - start
            if madvise(start, end - start, MADV_COLLAPSE) == 0:
                done.collapsed += end - start
    return done


class HugePagePromotion:
    """Promotes what a block of code allocated: create it before, :meth:`start` after."""

    def __init__(self) -> None:
        self.before = anonymous_regions() if enabled() else None
        self.result = Promotion()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Promote the mappings that appeared since construction, in a background thread."""
        if self.before is None:
            return
        regions = huge_aligned(added(anonymous_regions(), self.before))
        self.before = None
        if regions:
            self._thread = threading.Thread(target=self._run, args=(regions,), name="huge-pages", daemon=True)
            self._thread.start()
            _PENDING.append(self)

    def _run(self, regions: list[Region]) -> None:
        self.result = promote(regions)

    def wait(self) -> Promotion:
        """Block until the promotion is done (at once if there is none); what it did."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.result


_PENDING: list[HugePagePromotion] = []


def wait_all() -> Promotion:
    """Block until every promotion this process started is done (benchmarks call it before timing);
    what they did since the last call."""
    total = Promotion()
    while _PENDING:
        done = _PENDING.pop().wait()
        total.advised += done.advised
        total.collapsed += done.collapsed
    return total


_MADVISE = None


def _madvise():
    """libc's ``madvise`` (the call releases the GIL), or None where there is none."""
    global _MADVISE
    if _MADVISE is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            function = libc.madvise
        except (OSError, AttributeError, TypeError):
            _MADVISE = False
            return None
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        function.restype = ctypes.c_int
        _MADVISE = function
    return _MADVISE or None
