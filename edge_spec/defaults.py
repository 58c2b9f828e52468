"""What edge-spec does when a setting is not given, project-wide: where the models run (provider, threads),
the decoding mode, the exported context, and what ``edge-spec serve`` listens on and allows (the address,
the queue, the shutdown grace, the body limit).  The CLI's options, the Python API and the server take
their defaults from here, so a default is written once and the help states the one the code runs with
(tests/test_cli_names.py checks that they agree).

Kept free of the runtime, Starlette and uvicorn: the CLI reads it to build its help.
"""

from __future__ import annotations

import re

from edge_spec.errors import EdgeSpecError

DEFAULT_PROVIDER = "cpu"  # ONNX Runtime's execution provider for the target (and the drafter, unless set apart)
DEFAULT_THREADS = 0  # intra-op threads per session; 0: ONNX Runtime's choice, all cores
DEFAULT_MODE = "spec"  # what the CLI, the server and the Python API run when no mode is named
DEFAULT_CONTEXT_LENGTH = 4096  # tokens an exported bundle holds: KV cache capacity, rotary table size

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
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MODE",
    "DEFAULT_PORT",
    "DEFAULT_PROVIDER",
    "DEFAULT_SHUTDOWN_GRACE",
    "DEFAULT_THREADS",
    "format_size",
    "parse_size",
]
