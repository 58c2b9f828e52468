"""The peak resident memory of the calling process, for tests that run work in a child process.

``getrusage``'s ``ru_maxrss`` is no measure there on Linux: a child started by fork and exec inherits, as
its starting maximum, the resident size of the forked copy of its parent, and a pytest process that has
run a few hundred tests is larger than most children's own peak.  ``VmHWM`` belongs to the process's
current address space, which exec makes anew.  Standard library only, so that importing it costs the child
nothing."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """The highest resident memory of this process's current program, in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
