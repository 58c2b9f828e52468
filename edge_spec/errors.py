"""User-facing errors.

Anything raised as :class:`EdgeSpecError` is a user mistake or an environment
problem (missing file, wrong model pair, unknown provider, ...).  The CLI prints
it as one line and exits non-zero instead of showing a traceback.
"""


class EdgeSpecError(Exception):
    """An error whose message alone tells the user what to fix."""


def os_error_reason(exc: OSError) -> str:
    """What went wrong, in the system's words, lower-cased to sit inside a sentence ("no space left on
    device", "permission denied", "read-only file system", ...)."""
    reason = exc.strerror or (str(exc) if str(exc) else type(exc).__name__)
    if not exc.strerror and exc.errno:
        import os

        reason = os.strerror(exc.errno)
    return reason[:1].lower() + reason[1:]


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error that no writer explained: its reason and the path(s) it
    names (a write to a full disk, say, often names none)."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return os_error_reason(exc) + (f": {' -> '.join(paths)}" if paths else "")
