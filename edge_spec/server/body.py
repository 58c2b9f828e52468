"""JSON request bodies, decoded off the event loop with their nesting bounded.

Decoding a body of a few MiB takes long enough to hold up every other request (``/health`` included) if
it ran on the event loop, so it runs in a worker thread.  A body nested thousands of levels deep
(``[[[[...``) would make the decoder recurse until Python gives up with a RecursionError; the nesting is
measured first, without recursion, and refused past :data:`MAX_DEPTH` (no request of this API needs more
than a handful of levels).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from starlette.requests import Request

from edge_spec.server.errors import bad_request
from edge_spec.server.schemas import parse_json

MAX_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
T = TypeVar("T")


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def decode_object(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """The body as a JSON object, else a 400 in OpenAI's shape (bad JSON, not an object, nested too deep)."""
    openings = raw.count(b"[") + raw.count(b"{")  # fast: most bodies cannot nest deeper than this
    depth = nesting_depth(raw) if openings > max_depth else 0
    if depth > max_depth:
        raise bad_request(f"the JSON body nests {depth} levels deep; at most {max_depth} are accepted")
    try:
        return parse_json(raw)
    except RecursionError:  # cannot happen under the depth bound; never a traceback if it does
        raise bad_request(f"the JSON body nests too deeply; at most {max_depth} levels are accepted") from None


async def read_request(request: Request, parse: Callable[[dict], T]) -> T:
    """The request body decoded and turned into a typed request by ``parse``, both in a worker thread."""
    raw = await request.body()
    return await asyncio.to_thread(lambda: parse(decode_object(raw)))
