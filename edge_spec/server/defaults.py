"""What ``edge-spec serve`` does when an option is not given: the address, the queue, the shutdown grace and
the body limit.  The CLI's options and the server's functions take their defaults from here, so a default is
written once and the help states the one the server uses.

Kept free of Starlette and uvicorn: the CLI reads it to build its help.
"""

from __future__ import annotations

import re

from edge_spec.errors import EdgeSpecError

DEFAULT_HOST = "127.0.0.1"  # this machine only
DEFAULT_PORT = 8000  # vLLM's too, so a client's base URL carries over
DEFAULT_MAX_QUEUE = 16  # requests waiting behind the one being answered
DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds the answer in progress gets to finish on SIGINT / SIGTERM
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # a chat request near a 32k-token context is well under 1 MiB

_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)
_UNITS = " KMG"  # binary multiples: 1024 ** index


def parse_size(value: str | int) -> int:
    """Bytes from ``4194304``, ``512K``, ``8M``, ``1G`` (binary multiples; ``KiB`` / ``MB`` spellings too)."""
    if isinstance(value, int):
        size = value
    else:
        found = _SIZE.fullmatch(value.strip())
        if found is None:
            raise EdgeSpecError(f"--max-body must be a size such as 4M, 512K or 1048576, got {value!r}")
        size = int(found.group(1)) * 1024 ** _UNITS.index(found.group(2).upper() or " ")
    if size < 1:
        raise EdgeSpecError("--max-body must be at least 1 byte")
    return size


def format_size(size: int) -> str:
    """``size`` bytes as :func:`parse_size` reads them, in the largest unit that divides it (``4M``)."""
    for index in range(len(_UNITS) - 1, 0, -1):
        if size % 1024**index == 0:
            return f"{size // 1024**index}{_UNITS[index]}"
    return str(size)


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_PORT",
    "DEFAULT_SHUTDOWN_GRACE",
    "format_size",
    "parse_size",
]
